"""An `Entry` of `filter_jit`'s cache, built, traced and frozen in one place: the
function given to `jax.jit` (its dynamic trees keep the user's structure, so that
`in_shardings` and `out_shardings` are prefixes that `jax.jit` applies, and JAX's errors
name the user's arguments), the `jax.jit` itself, and the dispatch of its calls."""

import functools as ft
import inspect
from typing import Any

import jax
import jax._src.traceback_util as traceback_util
import jax.core
import jax.tree_util as jtu
import numpy as np
from equinox import is_array

from . import _callbacks, _checks, _donate
from ._cache import Cache, Layout
from ._mirror import getter, mirror
from ._place import device_put_leaves
from ._prepare import prepare
from ._sharding import resolve_leaves
from ._spec import check, context_mesh, for_jax, resolve, resolve_each
from ._spec_leaves import (
    Format,
    is_auto,
    is_rule,
    is_spec_leaf,
    PathRules,
    sharding_of,
    unset,
)


traceback_util.register_exclusion(__file__)


def mirror_partition(tree: Any) -> tuple[Any, tuple[tuple, Any]]:
    """Splits `tree` into its arrays, in its `mirror` (`None` at every other leaf), and
    a hashable `(leaves, treedef)` holding everything else (`None` at the arrays)."""
    leaves, treedef = jtu.tree_flatten(tree)
    mirrored = mirror(tree)
    mirror_leaves, mirror_def = jtu.tree_flatten(mirrored)
    dynamic = mirror_def.unflatten([x if is_array(x) else None for x in mirror_leaves])
    static = tuple(None if is_array(x) else x for x in leaves)
    return dynamic, (static, treedef)


def mirror_combine(dynamic: Any, static: tuple[tuple, Any]) -> Any:
    """The inverse of `mirror_partition`."""
    static_leaves, treedef = static
    arrays = iter(jtu.tree_leaves(dynamic))
    return treedef.unflatten([next(arrays) if s is None else s for s in static_leaves])


#
# The traced function: rebuilds the call from the dynamic trees and the static part,
# and returns the output's arrays in the output's own structure.
#


class OutStatic:
    """The non-array part of an output. `jax.jit` returns it as it is (a node with no
    children, itself its auxiliary data), so a call builds nothing for it."""

    def __init__(self, static_leaves: tuple, treedef: Any, mirrored: bool):
        self.treedef = treedef
        self.mirrored = mirrored
        self.static = tuple(x for x in static_leaves if x is not None)
        # Output leaf `i` is item `order[i]` of `arrays + self.static`: one C-speed
        # gather.
        order, n_arrays = [], sum(x is None for x in static_leaves)
        arrays = statics = 0
        for x in static_leaves:
            if x is None:
                order.append(arrays)
                arrays += 1
            else:
                order.append(n_arrays + statics)
                statics += 1
        self.gather = getter(tuple(order))

    def combine(self, dynamic: Any) -> Any:
        """The output, from the arrays that came back beside this: a tuple, else (under
        `out_shardings`) the output's mirror."""
        if self.mirrored:
            dynamic = tuple(jtu.tree_leaves(dynamic))
        return self.treedef.unflatten(self.gather(dynamic + self.static))


jtu.register_static(OutStatic)


def _traced_function(
    cache: Cache, static_fun, layout: Layout, leaves, targets, mesh, out_specs, found
):
    dynamic = set(layout.dynamic)
    static_leaves = tuple(None if i in dynamic else x for i, x in enumerate(leaves))
    treedef = layout.treedef
    # A single spec leaf is a prefix of any output, also of its flat arrays.
    structured = out_specs is not unset and not _is_single(out_specs)

    def fun_wrapped(dynamic_fun, dynamic_kwargs, *dynamic_args):
        fun = mirror_combine(dynamic_fun, static_fun)
        flat = list(static_leaves)
        dynamic = layout.packing.unpack(dynamic_kwargs, dynamic_args)
        for i, x in zip(layout.dynamic, dynamic):
            flat[i] = x
        if targets and jax.config.jax_disable_jit:  # pyright: ignore
            # `jax.jit` ignores `in_shardings` under `disable_jit`; we place anyway.
            device_put_leaves(
                treedef.unflatten(flat), flat, _concrete(flat, targets), "args"
            )
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
        fun_wrapped.__wrapped__ = cache.fun_source  # pyright: ignore
    # JAX names arguments by this signature in its errors: `model.layers[0].weight`.
    n_args = len(treedef.children()[0].children()) if treedef.children() else 0
    positional = inspect.Parameter.POSITIONAL_ONLY
    params = [
        inspect.Parameter(cache.fun_name, positional),
        inspect.Parameter(cache.kwargs_name, positional),
    ] + [inspect.Parameter(name, positional) for name in cache.names[:n_args]]
    if n_args > len(cache.names):
        params.append(
            inspect.Parameter(
                cache.var_name or "args", inspect.Parameter.VAR_POSITIONAL
            )
        )
    fun_wrapped.__signature__ = inspect.Signature(params)  # pyright: ignore
    return fun_wrapped


def _is_single(specs) -> bool:
    return jtu.tree_structure(specs, is_leaf=is_spec_leaf).num_nodes == 1


def _out_shardings(out, out_specs, found: list | None, structured: bool, mesh):
    """At trace time: checks `out_shardings` against the output, naming `out[...]`, and
    (for callable spec leaves) records the resolved shardings in `found`, on `mesh`:
    the mesh of the call, concrete where it was. Under `jax.disable_jit()` places the
    output instead, as `jax.jit` would have."""
    out_leaves, out_def = jtu.tree_flatten(out)
    todo = resolve_leaves(
        out,
        out_leaves,
        out_specs,
        "out_shardings",
        "out",
        abstract_ok=True,
        mesh=mesh,
        formats=True,
    )
    for i, sharding in todo:
        check(
            jax.numpy.shape(out_leaves[i]),
            sharding,
            lambda i=i: f"out{jtu.keystr(jtu.tree_flatten_with_path(out)[0][i][0])}",
        )
    if found is not None:
        # In the form in which the traced function returns the output's arrays.
        by_index = dict(todo)
        shardings = [by_index.get(i) for i in range(len(out_leaves))]
        if structured:
            found.append(jtu.tree_structure(mirror(out)).unflatten(shardings))
        else:
            found.append(tuple(s for s, x in zip(shardings, out_leaves) if is_array(x)))
    if jax.config.jax_disable_jit and todo:  # pyright: ignore
        device_put_leaves(out, out_leaves, _concrete(out_leaves, todo), "out")
        return out_def.unflatten(out_leaves)
    return out


def _concrete(leaves: list, todo: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
    """The items of `todo` whose leaf is a value: under `disable_jit`, a `vmap` or
    `grad` tracer is left as `jax.jit` leaves it (it has no placement to make). A
    `Layout.AUTO` has no compiler to choose it there: its sharding is placed."""
    return [
        (i, s.sharding if is_auto(s) else s)
        for i, s in todo
        if not isinstance(leaves[i], jax.core.Tracer)
    ]


def _static_out_shardings(out_specs):
    """`out_shardings` with every spec leaf that needs no output resolved to a
    `Sharding`: a `jax.Device`, or a bare `PartitionSpec` against the context mesh."""

    def resolve_leaf(path, spec):
        if spec is None or is_rule(spec) or isinstance(spec, PathRules):
            return spec  # resolved per output leaf, at trace time
        where = lambda: "out_shardings" + jtu.keystr(path)
        return for_jax(resolve(spec, None, where, abstract_ok=False))

    return jtu.tree_map_with_path(resolve_leaf, out_specs, is_leaf=is_spec_leaf)


class Entry:
    """One compiled function: a `jax.jit` for one static part of the arguments, and
    `dispatch(run, dynamic, deleted, leaves, jit_id)`, which calls it (`_donate.plain`,
    `_donate.serialized`, `_donate.donating`, `_callbacks.waiting`)."""

    __slots__ = (
        "layout",
        "static",
        "targets",
        "get_targets",
        "placed",  # `(True, sharding)` per target: committed there
        "donates",
        "jitted",
        "dispatch",
    )


def build_entry(wrapper, cache: Cache, layout: Layout, args, kwargs, leaves) -> tuple:
    """Resolves `in_shardings` for this call and checks each input against them
    (before anything runs), builds the `jax.jit`, places this call's inputs and
    traces it (not under `jax.disable_jit`): the entry, and this call's leaves and
    dynamic trees, as `prepare` returns them."""
    where = lambda i: _checks.arg_path(cache.names, args, kwargs, i)
    resolver = ft.partial(resolve, abstract_ok=True)
    targets = resolve_each(layout.specs, leaves, layout.dynamic, where, resolver)
    for i, sharding in targets:
        check(jax.numpy.shape(leaves[i]), sharding, lambda i=i: where(i))
    formats = targets
    auto = None
    if any(type(s) is Format for _, s in targets):
        auto = _auto_layouts(targets, leaves, where)
        # Inputs are placed on a `Format`'s sharding; its layout is `jax.jit`'s.
        targets = [(i, sharding_of(s)) for i, s in targets]
    entry = Entry()
    entry.layout = layout
    entry.static = layout.static_of(leaves)
    entry.targets = targets
    entry.get_targets = getter(tuple(i for i, _ in targets))
    entry.placed = tuple((True, s) for _, s in targets)
    entry.donates = bool(layout.donated) or (
        cache.donate_rest and wrapper._dynamic_fun is not None
    )
    jitted = entry.jitted = _jit(wrapper, cache, layout, args, leaves, formats)
    leaves, dynamic = prepare(
        wrapper._dynamic_fun, cache, entry, layout, args, kwargs, leaves
    )
    guards = None
    if not jax.config.jax_disable_jit:  # pyright: ignore
        with _donate.unusable_donations_ignored():
            if isinstance(jitted, ResolveRules):
                jitted = entry.jitted = jitted.trace(*dynamic)
            traced = jitted.trace(*dynamic)
            if _callbacks.has_callback(traced.jaxpr.jaxpr):
                guards = _callbacks.Guards(jitted, dynamic)
    if auto is not None:
        entry.jitted = AutoLayouts(entry.jitted, auto)
    shardings = [s for _, s in targets]
    shardings += [getattr(leaves[i], "sharding", None) for i in layout.dynamic]
    # The dispatch layers, innermost first: the launch, then its lock (donation's with
    # its re-check and warning filter), then the wait for callbacks.
    if entry.donates:
        entry.dispatch = _donate.donating(cache.filter_warning)
    elif _donate.serialize_dispatch(shardings):
        entry.dispatch = _donate.serialized
    else:
        entry.dispatch = _donate.plain
    if guards is not None:
        entry.dispatch = _callbacks.waiting(guards, entry.dispatch)
    return entry, leaves, dynamic


def _is_value(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic)) and not isinstance(
        x, jax.core.Tracer
    )


def _auto_layouts(targets, leaves, where) -> str | None:
    """For `in_shardings` with `Layout.AUTO`: raises, naming the first, if an array
    (not a `jax.ShapeDtypeStruct`) is passed for one, which `jax.jit` refuses; else the
    message that the entry's calls raise until it is compiled (`AutoLayouts`)."""
    auto = [i for i, s in targets if is_auto(s)]
    if not auto:
        return None
    message = lambda i: (
        f"{where(i)}: `in_shardings` gives it a `Format` with `Layout.AUTO`, a layout "
        "that the compiler chooses when the function is lowered, so it cannot be "
        "called with an array before then (`jax.jit` refuses a committed one, and "
        "`filter_jit` commits what it places). Lower and compile first, with "
        "`jax.ShapeDtypeStruct`s (`compiled = f.lower(*structs).compile()`), then "
        "place the arguments as the executable wants them "
        "(`args, _ = compiled.input_formats`; "
        "`eqxs.filter_device_put((model, ...), args)`) and call `compiled` or `f`, "
        "which then runs that executable."
    )
    for i in auto:
        if _is_value(leaves[i]):
            raise ValueError(message(i))
    return message(auto[0])


class AutoLayouts:
    """The `jax.jit` of an entry with `Layout.AUTO` in its `in_shardings`: lowered
    and traced as it is, but called only through the executable of its latest
    `Lowered.compile()`; until then a call raises `message` (naming the leaf)."""

    def __init__(self, jitted, message: str):
        self.jitted = jitted
        self.message = message
        self.compiled = None

    def trace(self, *args):
        return self.jitted.trace(*args)

    def lower(self, *args):
        return self.jitted.lower(*args)

    def __call__(self, *args):
        if any(isinstance(x, jax.core.Tracer) for x in jtu.tree_leaves(args)):
            # Inside an outer trace the compiler chooses the layout, as for `jax.jit`.
            return self.jitted(*args)
        compiled = self.compiled
        if compiled is None:
            raise ValueError(self.message)
        return compiled(*args)


def _jit(wrapper, cache: Cache, layout: Layout, args, leaves, targets):
    """The `jax.jit` of an entry (a `ResolveRules` for rules in `out_shardings`)."""
    jit_kwargs: dict = {}
    if cache.in_shardings is not unset:
        shardings: list = [None] * len(leaves)
        for i, sharding in targets:
            shardings[i] = for_jax(sharding)
        jit_kwargs["in_shardings"] = (None, *layout.packing.pack(shardings))
    jit_kwargs["donate_argnums"] = _donate.donate_argnums(
        cache.donate_first, cache.donate_rest, len(args)
    )
    out_specs = cache.out_shardings
    if out_specs is not unset:
        out_specs = _static_out_shardings(out_specs)
        if not cache.out_rules:
            mirrored = mirror(out_specs, is_leaf=is_spec_leaf)
            jit_kwargs["out_shardings"] = (mirrored, None)
    # Rules resolve on the call's mesh, which is concrete outside a trace: inside the
    # trace only its abstract mesh is available.
    mesh = context_mesh(abstract_ok=True) if cache.out_rules else None
    make = ft.partial(
        _traced_function, cache, wrapper._static_fun, layout, leaves, targets, mesh
    )
    if cache.out_rules:
        return ResolveRules(make, out_specs, jit_kwargs)
    return jax.jit(make(out_specs, None), **jit_kwargs)


class ResolveRules:
    """`out_shardings` with callable leaves need the output's shapes. The first call
    traces the function once (resolving the callables on its outputs), then builds the
    `jax.jit` that applies them around that trace: JAX reuses the inner trace, so the
    user's function is traced once."""

    def __init__(self, make, out_specs, jit_kwargs):
        self.make = make
        self.out_specs = out_specs
        self.jit_kwargs = jit_kwargs

    def __call__(self, *args):
        # Only under `jax.disable_jit()`, where nothing is traced: the function runs,
        # and its outputs are placed as they come.
        return jax.jit(self.make(self.out_specs, None), **self.jit_kwargs)(*args)

    def trace(self, *args):
        found: list = []
        fun_wrapped = self.make(self.out_specs, found)
        inner = jax.jit(fun_wrapped)
        inner.trace(*args)

        def outer(*args):
            return inner(*args)

        ft.update_wrapper(outer, fun_wrapped)
        del outer.__wrapped__
        if hasattr(fun_wrapped, "__wrapped__"):  # the user's function
            outer.__wrapped__ = fun_wrapped.__wrapped__  # pyright: ignore
        out_shardings = (jtu.tree_map(for_jax, found[0]), None)
        return jax.jit(outer, **self.jit_kwargs, out_shardings=out_shardings)
