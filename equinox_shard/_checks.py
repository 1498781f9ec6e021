"""Naming the user's arrays in `filter_jit`'s errors: the key path of a leaf of the
bound `(args, kwargs)`, e.g. `model.layers[0].weight`, and the diagnosis of an error
raised by `jax.jit`."""

from collections.abc import Sequence
from typing import Any

import jax
import jax._src.traceback_util as traceback_util
import jax.tree_util as jtu
from jax.sharding import Sharding

from ._donate import raise_if_deleted, raise_if_fun_deleted
from ._spec import check


traceback_util.register_exclusion(__file__)


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


def diagnose(
    cache: Any,
    args,
    kwargs,
    leaves: list,
    dynamic,
    targets: list[tuple[int, Sharding]],
    dynamic_fun: Any = None,
) -> None:
    """Called after `jax.jit` raised: raises our own error, naming the key path, if we
    can name the culprit (a deleted input, a bad shape)."""
    where = lambda i: arg_path(cache.names, args, kwargs, i)
    raise_if_deleted(leaves, dynamic, where)
    raise_if_fun_deleted(cache.fun_name, dynamic_fun)
    for i, sharding in targets:
        check(jax.numpy.shape(leaves[i]), sharding, lambda i=i: where(i))
