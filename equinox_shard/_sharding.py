"""`filter_device_put` and `filter_shard`: a PyTree's arrays placed (eagerly) or
constrained (in a trace) on what its specification resolves to (`_spec.language`)."""

import functools as ft
from collections.abc import Callable
from typing import Any

import jax
import jax._src.traceback_util as traceback_util
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


traceback_util.register_exclusion(__file__)


def _broadcast_flags(
    flags: Any, value: Any, leaves: list, name: str
) -> list | bool | None:
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
    return broadcast_specs(flag_leaves, flag_def, flags, value, len(leaves), name, "x")


def _constraint_function(sharding: Sharding, where: Callable[[], str]) -> str:
    if not isinstance(sharding, NamedSharding):
        return "with_sharding_constraint"
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
        return "reshard"
    return "with_sharding_constraint"


def _onto_mesh(x: Any, sharding: Any) -> Any:
    """`x`, replicated on `sharding`'s mesh where neither its type nor the context
    (`jax.set_mesh`) has a mesh: `reshard` takes the devices from those, so inside
    `jax.jit` on JAX's default (Explicit) mesh the program would otherwise have none."""
    if (
        isinstance(sharding, NamedSharding)
        and isinstance(sharding.mesh, Mesh)
        and jax.typeof(x).sharding.mesh.empty
        and context_mesh(abstract_ok=True) is None
    ):
        return jax.device_put(x, NamedSharding(sharding.mesh, PartitionSpec()))
    return x


def _in_host_memory(x: Any) -> bool:
    return getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host


def constrain_leaves(
    value: Any, leaves: list, todo: list[tuple[int, Any]], value_name: str
) -> None:
    """Constrains `leaves[i]` to `sharding` for each `(i, sharding)` in `todo`, in
    place, in a trace: `reshard` on Explicit axes, `with_sharding_constraint` on Auto
    ones, then `jax.device_put` where the memory kind changes (which they ignore)."""
    groups: dict[str, tuple[list, list]] = {}
    memory = []
    for i, sharding in todo:
        where = lambda i=i: leaf_path(value, i, value_name)
        kind = kind_of(sharding)
        how = InTrace.CONSTRAIN if kind is None else kind.in_trace
        if how is InTrace.TRANSFER:
            memory.append((i, sharding))
            continue
        if how is InTrace.REFUSED:
            raise TypeError(
                f"{where()}: inside a trace an array cannot be constrained to a "
                f"{kind.name} ({sharding}): {kind.in_trace_hint}."  # pyright: ignore
            )
        check(jax.numpy.shape(leaves[i]), sharding, where)
        indices, targets = groups.setdefault(
            _constraint_function(sharding, where), ([], [])
        )
        indices.append(i)
        targets.append(sharding)
        if not in_default_memory(sharding) or _in_host_memory(leaves[i]):
            memory.append((i, sharding))
    for function, (indices, targets) in groups.items():
        inputs = [leaves[i] for i in indices]
        targets = list(map(for_jax, targets))
        if function == "reshard":
            inputs = list(map(_onto_mesh, inputs, targets))
            out = jax.sharding.reshard(inputs, targets)
        else:
            out = lax.with_sharding_constraint(inputs, targets)
        for i, leaf in zip(indices, out):
            leaves[i] = leaf
    if memory:
        out = jax.device_put([leaves[i] for i, _ in memory], [s for _, s in memory])
        for (i, _), leaf in zip(memory, out):
            leaves[i] = leaf


_resolve = ft.partial(
    resolve_leaves, spec_name="device_or_shardings", value_name="x", formats=True
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

    Outside a trace this is one `jax.device_put`, batched over the arrays that need to
    move. It compiles and runs nothing of its own (unlike an eager
    `jax.lax.with_sharding_constraint` or `jax.jit`): only what `jax.device_put` does,
    e.g. a small slicing helper, cached per shape, the first time a single-device
    array is split across several. A committed array that already has an equivalent
    sharding (`Sharding.is_equivalent_to`) is returned as the same object, without
    calling `jax.device_put` at all.

    **Arguments:**

    - `x`: any PyTree. Its array leaves (`equinox.is_array`: JAX arrays, NumPy arrays,
        NumPy scalars and typed PRNG key arrays) are placed; everything else (Python
        scalars, functions, `jax.ShapeDtypeStruct`s, ...) is returned as-is.
    - `device_or_shardings`: a PyTree prefix of `x` whose leaves are each a
        `jax.sharding.Sharding`, a `jax.Device`, a bare `jax.sharding.PartitionSpec`
        (on the mesh set with `jax.set_mesh`), `None` (leave that subtree as it is),
        or a callable `leaf -> spec` called on each array beneath it. A
        `jax.experimental.layout.Format(layout, sharding)` places on `sharding` in
        `layout`, e.g. the leaves of `Compiled.input_formats` (whose non-array leaves,
        those of `x`, are accepted); `Layout.AUTO` cannot be placed (a `ValueError`:
        lower and compile first), and a typed PRNG key array is placed on the
        sharding alone. A `jax.memory.Space` (`Space.Host`) moves the array to that
        memory, keeping its sharding.
    - `donate`: passed to `jax.device_put`; a bool or a PyTree prefix of `x` of bools.
        Donation is best-effort, as in JAX: a donated input may hand its buffers to
        the result (whatever `may_alias` says), so it must not be used again.
    - `may_alias`: a bool, `None`, or a PyTree prefix of `x`. `None` (the default)
        returns an array that is already placed as the same object and copies every
        other one not donated; `False` copies even those; `True` lets a result share
        its input's buffers, as `jax.device_put` may, so donating that result later
        may delete the input. `donate` and `may_alias` both `True` for one array is a
        `ValueError`. An array that appears twice in `x` (tied weights) is placed
        once: both places hold the one result.

    **Returns:**

    A PyTree with the structure of `x`: array leaves placed (committed), with the same
    shapes and dtypes; other leaves the same objects. An array already placed is the
    very object of `x` (donating it later donates the array of `x`); every other
    array owns its buffers unless `may_alias=True` (donating it never deletes an array
    of `x`).

    **Raises:**

    Before any transfer, naming the leaf by its key path (`x[0]['w']`): `ValueError`
    if `device_or_shardings` is not a prefix of `x`, a `PartitionSpec` has more
    entries than the array has dimensions, a dimension is not divisible by its mesh
    axes, a bare `PartitionSpec` has no mesh, or a mesh axis is unknown; `TypeError`
    for a spec leaf of the wrong type or a callable that returns one. `RuntimeError`
    if an input array was already deleted (e.g. donated to an earlier call).

    !!! info "Inside a trace"

        Under `jax.jit`, `jax.vmap`, `jax.grad` or `jax.eval_shape`, this calls
        `jax.device_put` on the traced values, exactly as JAX does: on Auto mesh axes,
        that is *not* a sharding constraint (XLA's partitioner is free to ignore it),
        whilst on Explicit axes it changes the sharding in the type. To constrain an
        intermediate value, use [`equinox_shard.filter_shard`][] instead. Under
        `jax.disable_jit()` the values are concrete, so they are transferred.

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
        donate=_broadcast_flags(donate, x, leaves, "donate"),
        may_alias=_broadcast_flags(may_alias, x, leaves, "may_alias"),
    )
    return jtu.tree_unflatten(treedef, leaves)


def filter_shard(x: PyTree[Any], device_or_shardings: Any) -> PyTree[Any]:
    """Places or constrains the sharding of every array in a PyTree, eagerly or inside a
    trace, and returns every non-array leaf as the very same object.

    A drop-in replacement for `equinox.filter_shard` that does the right thing in every
    context:

    - **Outside a trace** (including under `jax.disable_jit()`): exactly
        [`equinox_shard.filter_device_put`][], one batched `jax.device_put`: nothing
        of its own compiled, already-placed arrays returned as the same object.
    - **Inside a trace** (`jax.jit`, `equinox.filter_jit`, `jax.vmap`, `jax.grad`,
        `jax.eval_shape`, ...), per array leaf: `jax.lax.with_sharding_constraint` on
        Auto mesh axes, or `jax.sharding.reshard` on Explicit ones (the default of
        `jax.make_mesh`; an array on no mesh, outside `jax.set_mesh`, is first put on
        the sharding's mesh, replicated, as `reshard` needs inside `jax.jit`); then,
        for a non-default memory kind such as `"pinned_host"` (which those two
        ignore), also `jax.device_put`. This applies to arrays that are not tracers
        too, such as constants closed over by a jitted function (under
        `jax.disable_jit()` those are placed instead).

    **Arguments:**

    - `x`: any PyTree; only its array leaves (`equinox.is_array`) are affected.
    - `device_or_shardings`: a PyTree prefix of `x` in the specification language of
        [`equinox_shard.filter_device_put`][]: a `jax.sharding.Sharding`, a
        `jax.Device`, a bare `jax.sharding.PartitionSpec` (needs `jax.set_mesh`), a
        `jax.experimental.layout.Format` (outside a trace only), a `jax.memory.Space`
        (moves the array to that memory, also inside a trace), `None` (leave as is),
        a callable `leaf -> spec` or an [`equinox_shard.PathRules`][].

    **Returns:**

    A PyTree with the structure of `x`, array leaves placed or constrained.

    **Raises:**

    As [`equinox_shard.filter_device_put`][]; inside a trace also a `ValueError`
    naming the key path if one `PartitionSpec` mixes Auto and Explicit mesh axes, and
    a `TypeError` naming it for a `Format` (constrain `format.sharding`, and the
    layout with `jax.experimental.layout.with_layout_constraint`). Checks happen
    before anything is transferred or traced.

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
    # Closed-over constants are constrained in a trace (`device_put` would not be a
    # constraint), but placed under `jax.disable_jit()` (nothing would constrain them).

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
