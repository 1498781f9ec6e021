"""The function that `jax.jit` traces for an entry of `filter_jit`: the call rebuilt,
`out_shardings` checked and resolved against its output, and the output's arrays."""

import functools as ft
import inspect
from typing import Any

import jax
import jax._src.traceback_util as traceback_util
import jax.tree_util as jtu
from equinox import is_array
from jax.sharding import AxisType, NamedSharding

from .._arrays import is_tracer
from .._placement import place, trimmed_spec
from .._spec.kinds import is_auto, kind_of, sharding_of
from .._spec.language import check_shapes, for_jax, leaf_path, resolve, resolve_leaves
from .._spec.leaves import is_rule, is_spec_leaf, may_be_own_leaf, PathRules, unset
from .cache import ArgStructure, Cache, unique_name
from .packing import mirror, mirror_combine, OutStatic


traceback_util.register_exclusion(__file__)


def traced_function(
    cache: Cache,
    static_fun,
    structure: ArgStructure,
    leaves,
    targets,
    mesh,
    out_specs,
    found,
):
    traced = set(structure.traced_indices)
    static_leaves = tuple(None if i in traced else x for i, x in enumerate(leaves))
    treedef = structure.treedef
    # A single spec leaf is a prefix of any output, also of its flat arrays.
    single = jtu.tree_structure(out_specs, is_leaf=is_spec_leaf).num_nodes == 1
    structured = out_specs is not unset and not single
    packing = structure.packing
    shardings = [(i, sharding_of(s)) for i, s in targets]
    # The spec on its mesh: without `jax.set_mesh` a bare spec names none (as typed:
    # its memory kind is `jax.jit`'s to place).
    explicit = [
        (i, NamedSharding(s.mesh, s.spec))
        for i, s in shardings
        if isinstance(s, NamedSharding) and AxisType.Explicit in s.mesh.axis_types
    ]

    def fun_wrapped(*slots):
        fun = mirror_combine(slots[packing.fun_at], static_fun)
        flat = list(static_leaves)
        dynamic = packing.unpack(slots)
        for i, x in zip(structure.traced_indices, dynamic):
            flat[i] = x
        if targets and jax.config.jax_disable_jit:
            # `jax.jit` ignores `in_shardings` under `disable_jit`; we place anyway.
            tree = treedef.unflatten(flat)
            where = lambda i: leaf_path(tree, i, "args")
            place(flat, _eager_targets(flat, targets), where)
        for i, s in explicit:
            have = jax.typeof(flat[i]).sharding
            if have.mesh.empty or trimmed_spec(have) != trimmed_spec(s):
                # Under a transform, an input of another type (uncommitted, which
                # `jax.jit` traces on no mesh): typed as `in_shardings` says.
                flat[i] = jax.sharding.reshard(flat[i], s)
        args, kwargs = treedef.unflatten(flat)
        out = fun(*args, **kwargs)
        if out_specs is not unset:
            out = _out_shardings(out, out_specs, found, structured, mesh)
        leaves, out_def = jtu.tree_flatten(out)
        static = tuple(None if is_array(x) else x for x in leaves)
        if structured:
            # The output's mirror, of which the mirrored `out_shardings` is a prefix.
            mirror_def = jtu.tree_structure(mirror(out))
            dynamic = mirror_def.unflatten(
                [x if s is None else None for x, s in zip(leaves, static)]
            )
            return dynamic, OutStatic(static, out_def, True)
        if out_specs is unset and all(x is None for x in static):
            return out, None
        # Flat: then `jax.jit` does not walk the output's Modules.
        arrays = tuple(x for x, s in zip(leaves, static) if s is None)
        return arrays, OutStatic(static, out_def, False)

    fun_wrapped.__name__, fun_wrapped.__qualname__ = cache.fun_names
    if cache.fun_source is not None:
        # JAX's messages point at this function's source: the user's, not ours.
        ft.update_wrapper(fun_wrapped, cache.fun_source, assigned=(), updated=())
    # JAX names arguments by this signature in its errors: `model.layers[0].weight`.
    names = list(cache.names[: packing.named])
    if packing.variadic:
        var = cache.var_name or "args"
        taken = {*names, cache.fun_name, cache.kwargs_name}
        for _ in packing.runs:  # `Packing.slots`'s variadic slots, each its own name
            names.append(unique_name(var, taken))
            taken.add(names[-1])
    names.insert(packing.fun_at, cache.fun_name)
    names.append(cache.kwargs_name)
    positional = inspect.Parameter.POSITIONAL_ONLY
    params = [inspect.Parameter(name, positional) for name in names]
    fun_wrapped.__signature__ = inspect.Signature(params)  # pyright: ignore
    return fun_wrapped


def _out_shardings(out, out_specs, found: list | None, structured: bool, mesh):
    """Checks `out_shardings` against the output (named `out[...]`) at trace time and
    records the shardings resolved on `mesh` in `found`; under `jax.disable_jit()`
    places the output, as `jax.jit` would have."""
    out_leaves, out_def = jtu.tree_flatten(out)
    todo = resolve_leaves(
        out,
        out_leaves,
        out_specs,
        "out_shardings",
        "out",
        abstract_ok=True,
        mesh=mesh,
        placement=True,
    )
    where = lambda i: leaf_path(out, i, "out")
    check_shapes(out_leaves, todo, where)
    # The kinds that `jax.jit` refuses in `out_shardings` apply here, as in a trace.
    body = [(i, s) for i, s in todo if in_body(s)]
    if body and not jax.config.jax_disable_jit:
        moved = jax.device_put([out_leaves[i] for i, _ in body], [s for _, s in body])
        for (i, _), x in zip(body, moved):
            out_leaves[i] = x
        out = out_def.unflatten(out_leaves)
    if found is not None:
        # In the form in which the traced function returns the arrays.
        by_index = {i: None if in_body(s) else s for i, s in todo}
        shardings = [by_index.get(i) for i in range(len(out_leaves))]
        if structured:
            found.append(jtu.tree_structure(mirror(out)).unflatten(shardings))
        else:
            found.append(tuple(s for s, x in zip(shardings, out_leaves) if is_array(x)))
    if jax.config.jax_disable_jit and todo:
        place(out_leaves, _eager_targets(out_leaves, todo), where)
        return out_def.unflatten(out_leaves)
    return out


def _eager_targets(leaves: list, todo: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
    """The items of `todo` to place under `disable_jit`: no `vmap` or `grad` tracer
    (`jax.jit` leaves it as it is), and a `Layout.AUTO` as its sharding."""
    return [
        (i, s.sharding if is_auto(s) else s)
        for i, s in todo
        if not is_tracer(leaves[i])
    ]


def in_body(spec: Any) -> bool:
    kind = kind_of(spec)
    return kind is not None and kind.jit_out == "body"


def static_out_shardings(out_specs):
    """`out_shardings` with every spec leaf that needs no output resolved (a
    `jax.Device`, a bare `PartitionSpec` against the context mesh)."""

    def resolve_leaf(path, spec):
        if spec is None or is_rule(spec) or isinstance(spec, PathRules):
            return spec  # resolved per output leaf, at trace time
        if may_be_own_leaf(spec):
            return spec  # the output's own leaf, checked against it at trace time
        where = lambda: "out_shardings" + jtu.keystr(path)
        return for_jax(resolve(spec, None, where, abstract_ok=False))

    return jtu.tree_map_with_path(resolve_leaf, out_specs, is_leaf=is_spec_leaf)


class ResolveRules:
    """`out_shardings` with callable leaves, resolved on the first trace's output and
    applied around that trace, which JAX reuses."""

    def __init__(self, make, out_specs, jit_kwargs):
        self.make = make
        self.out_specs = out_specs
        self.jit_kwargs = jit_kwargs

    def __call__(self, *args):
        # Only under `jax.disable_jit()`: nothing is traced; outputs are placed as made.
        return jax.jit(self.make(self.out_specs, None), **self.jit_kwargs)(*args)

    def trace(self, *args):
        found: list = []
        fun_wrapped = self.make(self.out_specs, found)
        inner = jax.jit(fun_wrapped)
        inner.trace(*args)

        def outer(*args):
            return inner(*args)

        ft.update_wrapper(outer, fun_wrapped)
        del outer.__wrapped__  # then `fun_wrapped`'s: the user's function, if any
        outer.__dict__.update(vars(fun_wrapped))
        out_shardings = (jtu.tree_map(for_jax, found[0]), None)
        return jax.jit(outer, **self.jit_kwargs, out_shardings=out_shardings)
