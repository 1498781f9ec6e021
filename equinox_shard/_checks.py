"""The checks that a `filter_jit` call makes before anything runs, and the diagnosis
of an error raised by `jax.jit`. Every message names the offending array by the user's
key path, e.g. `model.layers[0].weight`.

Leaves are those of the bound `(args, kwargs)`, flattened.
"""

import collections as co
from collections.abc import Sequence
from typing import Any

import jax
import jax.core
import jax.tree_util as jtu
from jax.sharding import Sharding

from ._spec import check


def arg_path(names: Sequence[str], args: tuple, kwargs: dict, index: int) -> str:
    """The key path of leaf `index` of `(args, kwargs)`, from the parameter name."""
    path, _ = jtu.tree_flatten_with_path((args, kwargs))[0][index]
    group, key, *rest = path
    if group.idx == 0:  # pyright: ignore
        position: int = key.idx  # pyright: ignore
        name = names[position] if position < len(names) else f"args[{position}]"
    else:
        name = str(key.key)  # pyright: ignore
    return name + jtu.keystr(tuple(rest))


def is_concrete_array(x: Any) -> bool:
    return isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)


def raise_if_deleted(names, args, kwargs, leaves: list, indices) -> None:
    """`RuntimeError`, naming the key path, for a deleted (e.g. donated) input."""
    for i in indices:
        x = leaves[i]
        if is_concrete_array(x) and x.is_deleted():
            raise RuntimeError(
                f"{arg_path(names, args, kwargs, i)}: this array has been deleted "
                "(was it donated to an earlier call?)."
            )


def raise_if_fun_deleted(fun_name: str, dynamic_fun: Any) -> None:
    """`RuntimeError`, naming the key path (`fun.weight`), for a deleted array of the
    function being JIT'd."""
    for path, x in jtu.tree_flatten_with_path(dynamic_fun)[0]:
        if is_concrete_array(x) and x.is_deleted():
            raise RuntimeError(
                f"{fun_name}{jtu.keystr(path)}: this array of the function being JIT'd "
                "has been deleted (was it donated to an earlier call?)."
            )


def donation_copies(
    names, args, kwargs, leaves: list, donated: tuple, dynamic: tuple, fun_leaves
) -> list[int] | None:
    """The donated leaves whose buffer is also reachable elsewhere in this call
    (donated twice, or donated and kept): donating one occurrence would invalidate the
    others within the same execution, which crashes XLA for multi-device arrays. Returns
    `None` in the common case (checked at C speed), else the leaf indices that must be
    given a private copy to donate.

    An array of the function being JIT'd (with `donate='all'`, `'warn'`, ...) that is
    also passed as an argument cannot be copied in its place: that raises."""
    dynamic_ids = {id(leaves[i]) for i in dynamic}
    fun_ids = {id(x) for x in fun_leaves}
    if len(dynamic_ids) == len(dynamic) and dynamic_ids.isdisjoint(fun_ids):
        return None
    counts = co.Counter(id(leaves[i]) for i in dynamic)
    for i in dynamic:
        if id(leaves[i]) in fun_ids:
            raise ValueError(
                f"{arg_path(names, args, kwargs, i)}: this array is also part of the "
                "function being JIT'd, whose arrays are donated; an array cannot be "
                "both donated and passed again."
            )
    return [i for i in donated if counts[id(leaves[i])] > 1] or None


def diagnose(
    names,
    args,
    kwargs,
    leaves: list,
    dynamic,
    targets: list[tuple[int, Sharding]],
    fun: tuple[str, Any] = ("fun", None),
) -> None:
    """Called after `jax.jit` raised: raises our own error, naming the key path, if we
    can name the culprit (a deleted input, a bad shape). `fun`:
    the name and the arrays (`dynamic_fun`) of the function being JIT'd."""
    raise_if_deleted(names, args, kwargs, leaves, dynamic)
    raise_if_fun_deleted(*fun)
    for i, sharding in targets:
        check(
            jax.numpy.shape(leaves[i]),
            sharding,
            lambda i=i: arg_path(names, args, kwargs, i),
        )
