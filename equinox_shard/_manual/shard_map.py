"""`filter_shard_map`: `jax.shard_map` over PyTrees of arrays and non-arrays, its specs
PyTree prefixes in the language of `_spec.language`."""

import functools as ft
from collections.abc import Callable
from typing import Any, overload, TypeVar

import jax
import jax._src.traceback_util as traceback_util
import jax.tree_util as jtu
from equinox import is_array
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import PyTree

from .._arrays import raise_if_deleted
from .._named import KeyPath, Named, Names
from .._spec.language import (
    call_rule,
    check,
    flatten_specs,
    leaf_path,
    mesh_or_context,
    resolve_each,
    spread,
)
from .._spec.leaves import (
    describe_leaf,
    is_rule,
    is_spec_leaf,
    may_be_own_leaf,
    PathRules,
    unset,
)


traceback_util.register_exclusion(__file__)


_T = TypeVar("_T", bound=Callable)


def _check_specs(specs: Any, name: str) -> None:
    """Spec leaves are `PartitionSpec`s over `mesh`: no sharding or device leaves."""
    flatten_specs(specs, name, own_leaves=True)  # the error for no spec leaf at all
    for path, leaf in jtu.tree_flatten_with_path(specs, is_leaf=is_spec_leaf)[0]:
        if may_be_own_leaf(leaf):  # an argument's own (`spread` checks it per call)
            continue
        inner = [("", leaf)]
        if isinstance(leaf, PathRules):
            inner = [(f" (its rule {p!r})", spec) for p, spec in leaf.rules]
            if leaf.default is not unset:
                inner.append((" (its default)", leaf.default))
        for which, spec in inner:
            if not (spec is None or isinstance(spec, PartitionSpec) or is_rule(spec)):
                raise TypeError(
                    f"{name}{jtu.keystr(path)}{which}: a `filter_shard_map` "
                    "specification leaf must be a `jax.sharding.PartitionSpec` (over "
                    "`mesh`), `None`, a callable `leaf -> PartitionSpec`, or an "
                    f"`equinox_shard.PathRules` of those; got {describe_leaf(spec)}."
                )


def _leaf_specs(
    specs: Any, value: Any, leaves: list, spec_name: str, value_name: str, mesh, shape
) -> list:
    """One `PartitionSpec | None` per leaf of `value` (`None` for non-array leaves),
    each checked to fit `shape(leaf)` on `mesh`."""
    where = lambda i: leaf_path(value, i, value_name)
    per_leaf = spread(specs, value, leaves, spec_name, value_name, where, is_array)
    indices = [i for i, leaf in enumerate(leaves) if is_array(leaf)]
    out: list = [None] * len(leaves)
    resolver = lambda s, leaf, at: call_rule(s, leaf, at) if is_rule(s) else s
    for i, spec in resolve_each(per_leaf, leaves, indices, where, resolver):
        if not isinstance(spec, PartitionSpec):
            raise TypeError(
                f"{where(i)}: a `filter_shard_map` specification must resolve to a "
                f"`jax.sharding.PartitionSpec` or `None`; got {describe_leaf(spec)}."
            )
        try:
            sharding = NamedSharding(mesh, spec)
        except Exception as e:  # an unknown axis, an axis used twice
            raise ValueError(f"{where(i)}: {e}") from e
        check(shape(leaves[i]), sharding, lambda i=i: where(i))
        out[i] = spec
    return out


def _unreplicated(fun, refused: list, manual: tuple) -> ValueError:
    """Our error for outputs `(key path, spec)` varying over `manual` axes they omit."""
    lines = []
    for key, spec in refused:
        left_out = tuple(a for a in manual if a not in _axes(spec))
        lines.append(
            f"- out{key}: its `out_specs` entry {spec} leaves out mesh axes "
            f"{left_out}, so it must be the same over them, but JAX infers that it "
            "varies across at least one of them."
        )
    name = getattr(fun, "__name__", type(fun).__name__)
    return ValueError(
        f"filter_shard_map({name}): an output that `out_specs` replicates is not "
        "the same on every device:\n" + "\n".join(lines) + "\nMake it the same on "
        "every device (e.g. `jax.lax.pmean(value, axis_name)`), name the axis in its "
        "`PartitionSpec` if each device holds its own block, or pass "
        "`check_vma=False` if it is the same on every device in fact."
    )


def _axes(spec: PartitionSpec) -> set:
    return {a for e in spec if e for a in (e if isinstance(e, tuple) else (e,))}


@overload
def filter_shard_map(
    *,
    in_specs: PyTree[Any],
    out_specs: PyTree[Any],
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
    axis_names: frozenset | set = frozenset(),
    check_vma: bool = True,
) -> Callable[[_T], _T]: ...


@overload
def filter_shard_map(
    fun: _T,
    *,
    in_specs: PyTree[Any],
    out_specs: PyTree[Any],
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
    axis_names: frozenset | set = frozenset(),
    check_vma: bool = True,
) -> _T: ...


def filter_shard_map(
    fun=unset,
    *,
    in_specs: PyTree[Any],
    out_specs: PyTree[Any],
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
    axis_names: frozenset | set = frozenset(),
    check_vma: bool = True,
) -> Any:
    """Filtered version of `jax.shard_map`: maps a function over the shards of the
    arrays in any PyTree (an `eqx.Module`, an optax state, a batch), and holds every
    other leaf static, as `equinox.filter_jit` does. Works eagerly, inside `filter_jit`
    or `jax.jit`, under `jax.grad` and `jax.vmap`, on Auto and Explicit mesh axes.

    **Arguments:**

    - `fun`: the function to map, called with the positional arguments, each array
        replaced by the block one device holds. Arrays in `fun` itself and in keyword
        arguments are not mapped: `fun` sees them whole.
    - `in_specs`: a PyTree prefix of the tuple of positional arguments. Its leaves are
        `PartitionSpec`s over `mesh`, `None` (`fun` sees the array whole), callables
        `leaf -> PartitionSpec | None`, or [`equinox_shard.PathRules`][] of those.
    - `out_specs`: a PyTree prefix of `fun`'s output, in the same language; `None`
        only over non-array outputs, which come back as the objects `fun` returned.
    - `mesh`: a `jax.sharding.Mesh` or `AbstractMesh`; defaults to the mesh set with
        `jax.set_mesh`.
    - `axis_names`, `check_vma`: as in `jax.shard_map`.

    **Returns:**

    A function with the same signature as `fun`, whose array outputs are assembled
    from their blocks according to `out_specs`.

    !!! example

        ```python
        mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
        linear = eqx.nn.Linear(16, 32, key=jr.key(0))

        # Row-parallel: each device holds 2 of the 16 input features.
        @eqxs.filter_shard_map(
            mesh=mesh, in_specs=(P(None, "x"), P("x")), out_specs=P()
        )
        def row_parallel(weight, x):
            return jax.lax.psum(weight @ x, "x")

        y = row_parallel(linear.weight, jnp.ones(16)) + linear.bias
        ```
    """
    options = dict(
        in_specs=in_specs,
        out_specs=out_specs,
        mesh=mesh,
        axis_names=axis_names,
        check_vma=check_vma,
    )
    if fun is unset:
        return ft.partial(filter_shard_map, **options)
    _check_specs(in_specs, "in_specs")
    _check_specs(out_specs, "out_specs")

    @ft.wraps(fun)
    def mapped(*args, **kwargs):
        mesh_ = mesh_or_context(mesh, "filter_shard_map")
        leaves, treedef = jtu.tree_flatten(args)
        where = lambda i: leaf_path(args, i, "args")
        raise_if_deleted(leaves, range(len(leaves)), where)
        specs = _leaf_specs(
            in_specs, args, leaves, "in_specs", "args", mesh_, jax.numpy.shape
        )
        indices = [i for i, s in enumerate(specs) if s is not None]
        manual = frozenset(axis_names) or frozenset(mesh_.axis_names)
        if indices and manual and all(a in mesh_.explicit_axes for a in manual):
            # Explicit axes: `jax.shard_map` needs each input typed as its spec.
            leaves = list(leaves)
            for i in indices:
                typed, spec = jax.typeof(leaves[i]).sharding, specs[i]
                # A type's spec has an entry per dimension; `P` equates `("x",)`, `"x"`.
                padded = PartitionSpec(*spec, *[None] * (leaves[i].ndim - len(spec)))
                if typed.mesh.empty or typed.spec != padded:
                    target = NamedSharding(mesh_, spec)
                    leaves[i] = jax.sharding.reshard(leaves[i], target)
        # Filled in by `body`; named by key path, which JAX's errors print.
        out_specs_named = Named((), Names(()))
        out_static: list = [None]
        # Outputs varying over an axis their spec leaves out: JAX's error names none.
        unreplicated: list = []
        in_order = tuple(a for a in mesh_.axis_names if a in manual)

        def body(dynamic):
            full = list(leaves)
            for i, x in zip(indices, dynamic):
                full[i] = x
            out = fun(*jtu.tree_unflatten(treedef, full), **kwargs)
            out_leaves, out_def = jtu.tree_flatten(out)
            # An output block needs at least as many dimensions as its spec.
            rank = lambda x: (0,) * jax.numpy.ndim(x)
            per_leaf = _leaf_specs(
                out_specs, out, out_leaves, "out_specs", "out", mesh_, rank
            )
            positions = [i for i, x in enumerate(out_leaves) if is_array(x)]
            for i in positions:
                if per_leaf[i] is None:
                    raise ValueError(
                        f"{leaf_path(out, i, 'out')}: an array output needs a "
                        "`PartitionSpec` in `out_specs` (`P()` if it is the same on "
                        "every device); got `None`."
                    )
            # JAX reads `out_specs` after tracing `body` (tests/test_jax_facts.py).
            paths = jtu.tree_flatten_with_path(out)[0]
            names = Names(tuple(KeyPath(jtu.keystr(paths[i][0])) for i in positions))
            out_specs_named.leaves = tuple(per_leaf[i] for i in positions)
            out_specs_named.names = names
            static = [None if is_array(x) else x for x in out_leaves]
            out_static[0] = (out_def, static, positions)
            varies = lambda x: jax.typeof(x).manual_axis_type.varying & manual
            unreplicated[:] = [
                (names.keys[k], per_leaf[i])
                for k, i in enumerate(positions)
                if check_vma and varies(out_leaves[i]) - _axes(per_leaf[i])
            ]
            return Named(tuple(out_leaves[i] for i in positions), names)

        # JAX's errors name the function it maps: the user's.
        body.__name__ = getattr(fun, "__name__", type(fun).__name__)

        run = jax.shard_map(
            body,
            mesh=mesh_,
            in_specs=([specs[i] for i in indices],),
            out_specs=out_specs_named,
            axis_names=frozenset(axis_names),
            check_vma=check_vma,
        )
        try:
            dynamic_out = run([leaves[i] for i in indices])
        except ValueError as e:
            if unreplicated:
                raise _unreplicated(fun, unreplicated, in_order) from e
            raise
        out_def, static, positions = out_static[0]  # pyright: ignore
        for i, x in zip(positions, dynamic_out.leaves):
            static[i] = x
        return jtu.tree_unflatten(out_def, static)

    return mapped
