"""`filter_device_put` and `filter_shard`: place (eagerly) or constrain (in a trace)."""

import functools as ft
from collections.abc import Callable
from typing import Any

import jax
import jax.lax as lax
import jax.tree_util as jtu
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec, Sharding
from jaxtyping import PyTree

from ._arrays import in_default_memory, is_tracer
from ._placement import place
from ._spec.kinds import InTrace, kind_of
from ._spec.language import (
    broadcast_specs,
    check,
    context_mesh,
    for_jax,
    in_trace,
    leaf_path,
    resolve_leaves,
)


def _broadcast_flags(flags: Any, x: Any, n: int, name: str) -> list | bool | None:
    is_flag = lambda x: x is None or isinstance(x, bool)
    if is_flag(flags):
        return flags  # pyright: ignore[reportReturnType]
    flag_leaves, flag_def = jtu.tree_flatten(flags, is_leaf=is_flag)
    for leaf in flag_leaves:
        if not is_flag(leaf):
            raise TypeError(
                f"`{name}` must be a bool or a PyTree prefix of `x` with bool leaves; "
                f"got a leaf {leaf!r}."
            )
    return broadcast_specs(flag_leaves, flag_def, flags, x, n, name, "x")


def _constraint(sharding: Sharding, where: Callable[[], str]) -> Callable:
    """`reshard` on Explicit mesh axes, `with_sharding_constraint` on Auto ones."""
    if not isinstance(sharding, NamedSharding):
        return lax.with_sharding_constraint
    mesh = sharding.mesh
    axis_types = dict(zip(mesh.axis_names, mesh.axis_types))
    # The mesh axes the spec names (`tree_leaves` drops its `None`s).
    used = {n for n in jtu.tree_leaves(tuple(sharding.spec)) if isinstance(n, str)}
    explicit = sorted(n for n in used if axis_types[n] == AxisType.Explicit)
    auto = sorted(n for n in used if axis_types[n] == AxisType.Auto)
    if explicit and auto:
        raise ValueError(
            f"{where()}: PartitionSpec {sharding.spec} mixes Explicit mesh axes "
            f"{explicit} with Auto mesh axes {auto}; inside a trace an array can be "
            "constrained on one kind only (`jax.sharding.reshard` for Explicit, "
            "`jax.lax.with_sharding_constraint` for Auto)."
        )
    if explicit or (not auto and AxisType.Explicit in mesh.axis_types):
        return _reshard
    return lax.with_sharding_constraint


def _reshard(inputs: list, targets: list) -> list:
    """`reshard`, first replicating onto its target's mesh an input on no mesh (in its
    type or `jax.set_mesh`): `reshard` inside `jax.jit` would find no devices."""
    if context_mesh(abstract_ok=True) is None:
        for k, (x, target) in enumerate(zip(inputs, targets)):
            mesh = getattr(target, "mesh", None)  # None for a bare `PartitionSpec`
            if isinstance(mesh, Mesh) and jax.typeof(x).sharding.mesh.empty:
                inputs[k] = jax.device_put(x, NamedSharding(mesh, PartitionSpec()))
    return jax.sharding.reshard(inputs, targets)


def constrain_leaves(
    value: Any, leaves: list, todo: list[tuple[int, Any]], value_name: str
) -> None:
    """Constrains `leaves[i]` to `sharding` for each `(i, sharding)` in `todo`, in
    place, in a trace (as `filter_shard` says)."""
    groups: dict[Callable, list[tuple[int, Any]]] = {}
    memory = []
    for i, sharding in todo:
        where = lambda i=i: leaf_path(value, i, value_name)
        kind: Any = kind_of(sharding)  # every resolved spec leaf is of a kind
        if kind.in_trace is InTrace.TRANSFER:
            memory.append((i, sharding))
            continue
        if kind.in_trace is InTrace.REFUSED:
            raise TypeError(
                f"{where()}: inside a trace an array cannot be constrained to a "
                f"{kind.name} ({sharding}): {kind.in_trace_hint}."
            )
        check(jax.numpy.shape(leaves[i]), sharding, where)
        function = _constraint(sharding, where)
        groups.setdefault(function, []).append((i, for_jax(sharding)))
        memory_space = getattr(jax.typeof(leaves[i]), "memory_space", None)
        if not in_default_memory(sharding) or memory_space == jax.memory.Space.Host:
            memory.append((i, sharding))
    groups[jax.device_put] = memory  # last: the constraints keep no memory kind
    for function, items in groups.items():
        if items:
            out = function([leaves[i] for i, _ in items], [s for _, s in items])
            for (i, _), leaf in zip(items, out):
                leaves[i] = leaf


_resolve = ft.partial(
    resolve_leaves, spec_name="device_or_shardings", value_name="x", placement=True
)


def filter_device_put(
    x: PyTree[Any],
    device_or_shardings: Any,
    *,
    donate: bool | PyTree[bool] = False,
    may_alias: bool | None | PyTree[bool | None] = None,
) -> PyTree[Any]:
    """Filtered version of `jax.device_put`: transfers every array in a PyTree to a
    device or sharding, and returns every non-array leaf as the very same object.

    Outside a trace this is one batched `jax.device_put`, compiling nothing of its own
    (unlike an eager `jax.lax.with_sharding_constraint`). A committed array already on
    an equivalent sharding (`Sharding.is_equivalent_to`) over the same mesh (on
    `Explicit` axes, with the same spec: both are part of its type) is returned as the
    same object.

    **Arguments:**

    - `x`: any PyTree. Its array leaves (`equinox.is_array`: JAX and NumPy arrays,
        NumPy scalars, typed PRNG key arrays) are placed; everything else (Python
        scalars, functions, `jax.ShapeDtypeStruct`s, ...) is returned as-is.
    - `device_or_shardings`: a PyTree prefix of `x` whose leaves are each a
        `jax.sharding.Sharding`, a `jax.Device`, a bare `jax.sharding.PartitionSpec`
        (on the mesh of `jax.set_mesh`), `None` (leave that subtree as it is), a
        callable `leaf -> spec` called on each array beneath it, a `jax.memory.Space`
        (moves the array there, keeping its sharding), or a
        `jax.experimental.layout.Format`, e.g. the leaves of `Compiled.input_formats`
        (non-array ones too; `Layout.AUTO` is a `ValueError`). See docs/semantics.md.
    - `donate`: a bool or a PyTree prefix of `x` of bools, passed to `jax.device_put`:
        best-effort, as in JAX, so a donated input must not be used again.
    - `may_alias`: a bool, `None`, or a PyTree prefix of `x`. `None` (the default)
        copies every array not already placed nor donated; `False` copies even those;
        `True` lets a result share its input's buffers, as `jax.device_put` may.
        `donate` and `may_alias` both `True` for one array is a `ValueError`.

    **Returns:**

    A PyTree like `x`, its array leaves placed (committed); an array that appears twice
    (tied weights) is placed once. An array already placed is the very object of `x`;
    any other owns its buffers (donating it never deletes an array of `x`) unless
    `may_alias=True`.

    **Raises:**

    Before any transfer, naming the leaf by its key path (`x[0]['w']`): `ValueError`
    if `device_or_shardings` is not a prefix of `x`, a `PartitionSpec` has more
    entries than the array has dimensions, a dimension is not divisible by its mesh
    axes, a bare `PartitionSpec` has no mesh, or a mesh axis is unknown; `TypeError`
    for a spec leaf of the wrong type or a callable that returns one. `RuntimeError`
    if an input array was already deleted (e.g. donated to an earlier call).

    !!! info "Inside a trace"

        Under `jax.jit`, `jax.vmap`, `jax.grad` or `jax.eval_shape`, this is
        `jax.device_put` on the traced values: on Auto mesh axes *not* a sharding
        constraint (XLA may ignore it), on Explicit axes a change of the type's
        sharding. To constrain a value, use [`equinox_shard.filter_shard`][].

    !!! example

        ```python
        mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
        model = eqx.nn.MLP(2, 2, 64, 2, key=jr.key(0))
        replicated = jax.sharding.NamedSharding(mesh, jax.P())
        model = eqxs.filter_device_put(model, replicated)  # model.activation untouched
        ```
    """
    leaves, treedef = jtu.tree_flatten(x)
    traced = any(map(is_tracer, leaves))
    todo = _resolve(x, leaves, device_or_shardings, abstract_ok=traced)
    if not todo:
        return x
    place(
        leaves,
        todo,
        lambda i: leaf_path(x, i, "x"),
        donate=_broadcast_flags(donate, x, len(leaves), "donate"),
        may_alias=_broadcast_flags(may_alias, x, len(leaves), "may_alias"),
    )
    return jtu.tree_unflatten(treedef, leaves)


def filter_shard(x: PyTree[Any], device_or_shardings: Any) -> PyTree[Any]:
    """Places or constrains the sharding of every array in a PyTree, eagerly or inside a
    trace, and returns every non-array leaf as the very same object.

    A drop-in replacement for `equinox.filter_shard`, right in every context:

    - **Outside a trace** (including under `jax.disable_jit()`): exactly
        [`equinox_shard.filter_device_put`][].
    - **Inside a trace** (`jax.jit`, `equinox.filter_jit`, `jax.vmap`, `jax.grad`,
        `jax.eval_shape`, ...), per array leaf, even a closed-over constant:
        `jax.lax.with_sharding_constraint` on Auto mesh axes, `jax.sharding.reshard`
        on Explicit ones (the default of `jax.make_mesh`, also outside `jax.set_mesh`),
        then `jax.device_put` for a non-default memory kind such as `"pinned_host"`.

    **Arguments:**

    - `x`: any PyTree; only its array leaves (`equinox.is_array`) are affected.
    - `device_or_shardings`: as in [`equinox_shard.filter_device_put`][] (a
        `jax.sharding.Sharding`, `jax.Device`, `jax.sharding.PartitionSpec`,
        `jax.memory.Space`, `None`, callable or [`equinox_shard.PathRules`][]), but a
        `jax.experimental.layout.Format` outside a trace only.

    **Returns:**

    A PyTree like `x`, its array leaves placed or constrained.

    **Raises:**

    As [`equinox_shard.filter_device_put`][], before anything is transferred or
    traced; inside a trace also a `ValueError` naming the key path if one
    `PartitionSpec` mixes Auto and Explicit mesh axes, and a `TypeError` naming it for
    a `Format` (constrain `format.sharding`, and the layout with
    `jax.experimental.layout.with_layout_constraint`).

    !!! example

        ```python
        mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
        replicated = jax.NamedSharding(mesh, jax.P())
        batch_sharding = jax.NamedSharding(mesh, jax.P("data"))

        @eqx.filter_jit
        def step(model, x):
            x = eqxs.filter_shard(x, batch_sharding)  # a constraint, inside jit
            ...

        model = eqxs.filter_shard(model, replicated)  # a transfer, outside jit
        ```
    """
    leaves, treedef = jtu.tree_flatten(x)
    # Closed-over constants are constrained in a trace, placed under `disable_jit`.
    traced = any(map(is_tracer, leaves)) or (
        in_trace() and not jax.config.jax_disable_jit  # pyright: ignore
    )
    todo = _resolve(x, leaves, device_or_shardings, abstract_ok=traced)
    if not todo:
        return x
    if traced:
        constrain_leaves(x, leaves, todo, "x")
    else:
        place(leaves, todo, lambda i: leaf_path(x, i, "x"))
    return jtu.tree_unflatten(treedef, leaves)
