import collections as co
import functools as ft
import inspect
import operator
import os
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any, Literal, overload, TypeVar
from typing_extensions import ParamSpec

import equinox as eqx
import equinox._caches
import equinox.internal as eqxi
import jax
import jax._src.traceback_util as traceback_util
import jax.core
import jax.tree_util as jtu
from equinox import field, is_array, Module, module_update_wrapper, Partial

from . import _callbacks, _checks, _commit
from ._sharding import device_put_leaves, resolve_leaves
from ._spec import (
    broadcast_specs,
    check,
    context_mesh,
    flatten_specs,
    is_rule,
    is_spec_leaf,
    resolve,
)


traceback_util.register_exclusion(__file__)


_P = ParamSpec("_P")
_T = TypeVar("_T")

_DonateMode = Literal["all", "all-except-first", "warn", "warn-except-first", "none"]

# mode -> (donate_first, donate_rest, filter_warning)
_DONATE_MODES = {
    "all": (True, True, True),
    "all-except-first": (False, True, True),
    "warn": (True, True, False),
    "warn-except-first": (False, True, False),
    "none": (False, False, False),
}


class _Unset:
    def __repr__(self):
        return "<unset>"


_unset: Any = _Unset()


_is_deleted = operator.methodcaller("is_deleted")


def hashable_partition(tree: Any) -> tuple[Any, tuple[tuple, Any]]:
    """Splits `tree` into a PyTree of the same structure holding its arrays (`None` at
    every other leaf), and a hashable `(leaves, treedef)` holding everything else."""
    leaves, treedef = jtu.tree_flatten(tree)
    dynamic = [x if is_array(x) else None for x in leaves]
    static = tuple(None if is_array(x) else x for x in leaves)
    return treedef.unflatten(dynamic), (static, treedef)


def hashable_combine(dynamic: Any, static: tuple[tuple, Any]) -> Any:
    """The inverse of `hashable_partition`."""
    static_leaves, treedef = static
    if dynamic is None:
        return treedef.unflatten(static_leaves)
    dynamic_leaves = treedef.flatten_up_to(dynamic)
    leaves = [d if s is None else s for d, s in zip(dynamic_leaves, static_leaves)]
    return treedef.unflatten(leaves)


def _is_array_or_struct(x: Any) -> bool:
    return is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


#
# Caches. One per decoration, owned by it: compiled functions are released with the
# wrapper, whatever the function is (a `functools.partial`, a lambda, a Module).
#


class _Cache:
    """The configuration of one `filter_jit` decoration and its compiled functions:
    `layouts[(treedef, leaf types)]` -> `_Layout`, whose `entries[static key]` ->
    `_Entry`."""

    def __init__(self, fun, donate, in_shardings, out_shardings):
        try:
            self.donate_first, self.donate_rest, self.filter_warning = _DONATE_MODES[
                donate
            ]
        except (KeyError, TypeError):
            raise ValueError(
                "`filter_jit(..., donate=...)` must be one of 'all', "
                "'all-except-first', 'warn', 'warn-except-first', or 'none'; got "
                f"{donate!r}."
            ) from None
        self.signature = signature = inspect.signature(fun)
        params = list(signature.parameters.values())
        positional = [
            p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        var = [p.name for p in params if p.kind is p.VAR_POSITIONAL]
        var_keyword = [p.name for p in params if p.kind is p.VAR_KEYWORD]
        self.names = tuple(p.name for p in positional)
        self.var_name = var[0] if var else None
        taken = {p.name for p in params}
        self.fun_name = _unique("fun", taken)
        self.kwargs_name = var_keyword[0] if var_keyword else _unique("kwargs", taken)
        self.min_args = sum(p.default is p.empty for p in positional)
        self.max_args = float("inf") if var else len(positional)
        self.in_shardings = in_shardings
        self.in_leaves = None
        if in_shardings is not _unset:
            self.in_leaves, treedef = flatten_specs(in_shardings, "in_shardings")
            if treedef.num_nodes == 1 and treedef.num_leaves == 1:
                self.in_kind = "broadcast"
            elif type(in_shardings) in (tuple, list):
                self.in_kind = "positional"
                if not var and len(in_shardings) != len(positional):
                    raise ValueError(
                        "`in_shardings` must be a single specification (applied to "
                        "every argument) or a tuple with one entry per positional "
                        f"parameter of `{_fn_names(fun)[1]}`, which has "
                        f"{len(positional)} ({', '.join(self.names) or 'none'}); got "
                        f"{len(in_shardings)} entries."
                    )
            else:
                raise TypeError(
                    "`in_shardings` must be a single specification (applied to every "
                    "argument) or a tuple with one entry per positional parameter; "
                    f"got a {type(in_shardings).__name__}. To give one argument a "
                    "PyTree of shardings, wrap it in a tuple: `in_shardings=(spec,)`."
                )
        self.out_shardings = out_shardings
        out_leaves = []
        if out_shardings is not _unset:
            out_leaves, _ = flatten_specs(out_shardings, "out_shardings")
        self.out_rules = any(map(is_rule, out_leaves))
        self.out_mesh = any(isinstance(x, jax.P) for x in out_leaves)
        self.fun_names = _fn_names(fun)
        self.layouts: dict = {}
        self.entries: dict = {}
        self.lock = threading.Lock()
        _live_caches.add(self)

    def clear(self):
        with self.lock:
            self.layouts = {}
            self.entries = {}


# Every live `_Cache`, so that `eqx.clear_caches()` clears them. Equinox has no public
# way to register a cache with `clear_caches`; its own caches append to this list.
_live_caches: weakref.WeakSet = weakref.WeakSet()


def _clear_caches() -> None:
    with _caches_lock:
        _recent_caches.clear()
    for cache in list(_live_caches):
        cache.clear()


equinox._caches.cache_clears.append(_clear_caches)


# Decorations of equal functions (equal static parts: a fresh `functools.partial`, a
# fresh bound method, `eqx.filter_grad(f)` made again) with equal configuration share
# one `_Cache`, as in `eqx.filter_jit`: while one of their wrappers is alive, and for the
# `_RECENT` most recently used configurations after that. So nothing grows without
# bound when wrappers are made in a loop (tests/test_jit_core.py::
# test_fresh_partials_release_compiled_state).
_RECENT = 8
_shared_caches: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_recent_caches: co.OrderedDict = co.OrderedDict()
_caches_lock = threading.Lock()


def _get_cache(fun, static_fun, donate, in_shardings, out_shardings) -> _Cache:
    def spec_key(specs):
        if specs is _unset:
            return None
        leaves, treedef = jtu.tree_flatten(specs, is_leaf=is_spec_leaf)
        return tuple(leaves), treedef

    key = (static_fun, donate, spec_key(in_shardings), spec_key(out_shardings))
    try:
        hash(key)
    except TypeError:  # unhashable: not shared
        return _Cache(fun, donate, in_shardings, out_shardings)
    with _caches_lock:
        cache = _shared_caches.get(key)
        if cache is None:
            cache = _Cache(fun, donate, in_shardings, out_shardings)
            _shared_caches[key] = cache
        _recent_caches[key] = cache
        _recent_caches.move_to_end(key)
        while len(_recent_caches) > _RECENT:
            _recent_caches.popitem(last=False)
    return cache


def _unique(name: str, taken: set) -> str:
    while name in taken:
        name = name + "_"
    return name


def _fn_names(fun) -> tuple[str, str]:
    while True:
        if isinstance(fun, ft.partial):
            fun = fun.func
        elif hasattr(fun, "__wrapped__") and not isinstance(fun, Module):
            fun = fun.__wrapped__
        else:
            break
    try:
        return fun.__name__, fun.__qualname__
    except AttributeError:
        return type(fun).__name__, type(fun).__qualname__


class _Layout:
    """What depends only on the structure and leaf types of the bound arguments: which
    leaves are traced and donated, and the `in_shardings` leaf above each leaf."""

    def __init__(self, cache: _Cache, args, kwargs, leaves, treedef, dynamic):
        mask = tuple(map(dynamic, leaves))
        self.treedef = treedef
        self.dynamic = tuple(i for i, m in enumerate(mask) if m)
        self.dynamic_leaves = _getter(self.dynamic)
        static = tuple(i for i, m in enumerate(mask) if not m)
        self.static_of = _getter(static)
        # `dynamic_of(leaves + [None])`: the leaves with `None` at static positions.
        n = len(leaves)
        self.dynamic_of = (
            None
            if not static
            else _getter(tuple(i if m else n for i, m in enumerate(mask)))
        )
        n_first = len(jtu.tree_leaves(args[0])) if args else 0
        self.donated = tuple(
            i
            for i in self.dynamic
            if (cache.donate_first if i < n_first else cache.donate_rest)
        )
        self.specs = _in_specs(cache, args, leaves)
        self.rules = tuple(i for i in self.dynamic if is_rule(self.specs[i]))
        self.needs_mesh = cache.out_mesh or any(
            isinstance(s, jax.P) for s in self.specs
        )
        # Shared by every layout with the same traced leaves (e.g. NumPy or JAX).
        self.entries = cache.entries.setdefault((treedef, mask), {})

    def key(self, leaves: list) -> Any:
        key = self.static_of(leaves)
        if self.rules or self.needs_mesh:
            avals = tuple((leaves[i].shape, leaves[i].dtype) for i in self.rules)
            mesh = context_mesh(abstract_ok=True) if self.needs_mesh else None
            key = (key, avals, mesh)
        return key


def _getter(indices: tuple[int, ...]) -> Callable[[Any], tuple]:
    # `operator.itemgetter` gathers at C speed; it returns a bare item for one index.
    if len(indices) == 0:
        return lambda leaves: ()
    if len(indices) == 1:
        (i,) = indices
        return lambda leaves: (leaves[i],)
    return operator.itemgetter(*indices)


def _in_specs(cache: _Cache, args: tuple, leaves: list) -> list:
    """One `in_shardings` leaf per leaf of the bound `(args, kwargs)`."""
    if cache.in_shardings is _unset:
        return [None] * len(leaves)
    if cache.in_kind == "broadcast":
        return cache.in_leaves * len(leaves)  # pyright: ignore
    if cache.var_name is not None and len(cache.in_shardings) != len(args):
        raise ValueError(
            f"`in_shardings` has {len(cache.in_shardings)} entries but the call has "
            f"{len(args)} positional arguments."
        )
    out = []
    for position, (spec, arg) in enumerate(zip(cache.in_shardings, args)):
        name = f"in_shardings[{position}]"
        spec_leaves, spec_def = flatten_specs(spec, name)
        n = len(jtu.tree_leaves(arg))
        arg_name = (
            cache.names[position]
            if position < len(cache.names)
            else f"args[{position}]"
        )
        out.extend(broadcast_specs(spec_leaves, spec_def, spec, arg, n, name, arg_name))
    return out + [None] * (len(leaves) - len(out))  # keyword arguments


class _Entry:
    """One compiled function: a `jax.jit` for one static part of the arguments."""

    __slots__ = (
        "layout",
        "static",
        "jitted",
        "targets",
        "get_targets",
        "wait",
        "serialize",
    )


#
# The traced function: rebuilds the call from the dynamic trees and the static part,
# and returns the output's arrays in the output's own structure.
#


def _traced_function(
    cache: _Cache, static_fun, layout: _Layout, leaves, targets, out_specs, found
):
    static_leaves = tuple(
        None if i in set(layout.dynamic) else x for i, x in enumerate(leaves)
    )
    treedef = layout.treedef

    def fun_wrapped(dynamic_fun, dynamic_kwargs, *dynamic_args):
        fun = hashable_combine(dynamic_fun, static_fun)
        dynamic = treedef.flatten_up_to((dynamic_args, dynamic_kwargs))
        flat = [d if s is None else s for d, s in zip(dynamic, static_leaves)]
        if targets and jax.config.jax_disable_jit:  # pyright: ignore
            # `jax.jit` ignores `in_shardings` under `disable_jit`; we place anyway.
            device_put_leaves(treedef.unflatten(flat), flat, targets, "args")
        args, kwargs = treedef.unflatten(flat)
        out = fun(*args, **kwargs)
        if out_specs is not _unset:
            out = _out_shardings(out, out_specs, found)
        dynamic_out, static_out = hashable_partition(out)
        if all(x is None for x in static_out[0]):
            return dynamic_out, None
        return dynamic_out, eqxi.Static(static_out)

    fun_wrapped.__name__, fun_wrapped.__qualname__ = cache.fun_names
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


def _out_shardings(out, out_specs, found: list | None):
    """At trace time: checks `out_shardings` against the output, naming `out[...]`, and
    (for callable spec leaves) records the resolved shardings in `found`. Under
    `jax.disable_jit()` places the output instead, as `jax.jit` would have."""
    out_leaves, out_def = jtu.tree_flatten(out)
    todo = resolve_leaves(
        out, out_leaves, out_specs, "out_shardings", "out", abstract_ok=True
    )
    for i, sharding in todo:
        check(
            jax.numpy.shape(out_leaves[i]),
            sharding,
            lambda i=i: f"out{jtu.keystr(jtu.tree_flatten_with_path(out)[0][i][0])}",
        )
    if found is not None:
        by_index = dict(todo)
        found.append(
            out_def.unflatten([by_index.get(i) for i in range(len(out_leaves))])
        )
    if jax.config.jax_disable_jit and todo:  # pyright: ignore
        device_put_leaves(out, out_leaves, todo, "out")
        return out_def.unflatten(out_leaves)
    return out


def _static_out_shardings(out_specs):
    """`out_shardings` with every spec leaf that needs no output resolved to a
    `Sharding`: a `jax.Device`, or a bare `PartitionSpec` against the context mesh."""

    def resolve_leaf(spec):
        if spec is None or is_rule(spec):
            return spec
        return resolve(spec, None, lambda: "out_shardings", abstract_ok=False)

    return jtu.tree_map(resolve_leaf, out_specs, is_leaf=is_spec_leaf)


def _new_entry(wrapper, cache: _Cache, layout: _Layout, args, kwargs, leaves) -> _Entry:
    """Resolves `in_shardings` for this call, checks committed inputs against them
    (before anything is traced), and builds the `jax.jit`."""
    names = cache.names
    targets = []
    for i in layout.dynamic:
        spec = layout.specs[i]
        if spec is None:
            continue
        where = lambda i=i: _checks.arg_path(names, args, kwargs, i)
        sharding = resolve(spec, leaves[i], where, abstract_ok=True)
        if sharding is not None:
            check(jax.numpy.shape(leaves[i]), sharding, where)
            targets.append((i, sharding))
    _checks.raise_if_committed_elsewhere(names, args, kwargs, leaves, targets)
    entry = _Entry()
    entry.layout = layout
    entry.static = layout.static_of(leaves)
    entry.targets = targets
    entry.get_targets = _getter(tuple(i for i, _ in targets))
    entry.wait = None
    entry.serialize = _serialize_dispatch(
        [s for _, s in targets]
        + [getattr(leaves[i], "sharding", None) for i in layout.dynamic]
    )
    jit_kwargs: dict = {}
    if cache.in_shardings is not _unset:
        shardings: list = [None] * len(leaves)
        for i, sharding in targets:
            shardings[i] = sharding
        args_shardings, kwargs_shardings = layout.treedef.unflatten(shardings)
        jit_kwargs["in_shardings"] = (None, kwargs_shardings, *args_shardings)
    n_args = len(args)
    donate = [0, 1] if cache.donate_rest else []
    if n_args and cache.donate_first:
        donate.append(2)
    if cache.donate_rest:
        donate.extend(range(3, 2 + n_args))
    jit_kwargs["donate_argnums"] = tuple(donate)
    out_specs = cache.out_shardings
    if out_specs is not _unset:
        out_specs = _static_out_shardings(out_specs)
        if not cache.out_rules:
            jit_kwargs["out_shardings"] = (out_specs, None)
    static_fun = wrapper._static_fun
    make = ft.partial(_traced_function, cache, static_fun, layout, leaves, targets)
    entry.jitted = jax.jit(make(out_specs, None), **jit_kwargs)
    if cache.out_rules:
        entry.jitted = _ResolveRules(make, out_specs, jit_kwargs)
    return entry


class _ResolveRules:
    """`out_shardings` with callable leaves need the output's shapes. The first call
    traces the function once (resolving the callables on its outputs), then builds the
    `jax.jit` that applies them around that trace: JAX reuses the inner trace, so the
    user's function is traced once."""

    def __init__(self, make, out_specs, jit_kwargs):
        self.make = make
        self.out_specs = out_specs
        self.jit_kwargs = jit_kwargs

    def trace(self, *args):
        found: list = []
        fun_wrapped = self.make(self.out_specs, found)
        inner = jax.jit(fun_wrapped)
        inner.trace(*args)

        def outer(*args):
            return inner(*args)

        ft.update_wrapper(outer, fun_wrapped)
        del outer.__wrapped__
        out_shardings = (found[0], None)
        return jax.jit(outer, **self.jit_kwargs, out_shardings=out_shardings)


#
# The call path: bind, flatten, look up, check, place, call `jax.jit`.
#


def _bind(cache: _Cache, args, kwargs):
    if kwargs or not (cache.min_args <= len(args) <= cache.max_args):
        bound = cache.signature.bind(*args, **kwargs)
        return bound.args, bound.kwargs
    return args, kwargs


def _prepare(wrapper, cache: _Cache, entry: _Entry, args, kwargs, leaves):
    """Checks and placements before execution; returns the dynamic trees to call with."""
    layout = entry.layout
    dynamic_fun = wrapper._dynamic_fun
    changed = False
    # XLA crashes on a deleted multi-device input, donated or not.
    try:
        deleted = any(map(_is_deleted, layout.dynamic_leaves(leaves)))
    except (AttributeError, TypeError):  # NumPy arrays, tracers: one by one
        deleted = True
    if deleted:
        _checks.raise_if_deleted(cache.names, args, kwargs, leaves, layout.dynamic)
    if layout.donated or (cache.donate_rest and dynamic_fun is not None):
        fun_leaves = jtu.tree_leaves(dynamic_fun) if cache.donate_rest else ()
        if any(x.is_deleted() for x in fun_leaves if isinstance(x, jax.Array)):
            raise RuntimeError(
                "An array of the function being JIT'd has been deleted (was it "
                "donated to an earlier call?)."
            )
        copies = _checks.donation_copies(
            cache.names,
            args,
            kwargs,
            leaves,
            layout.donated,
            layout.dynamic,
            fun_leaves,
        )
        if copies:
            # The caller's buffer is kept; the executable donates a private copy.
            leaves = list(leaves)
            moved = jax.device_put(
                [leaves[i] for i in copies],
                [leaves[i].sharding for i in copies],
                may_alias=False,
            )
            for i, x in zip(copies, moved):
                leaves[i] = x
            changed = True
    if entry.targets and not _commit.all_committed(entry.get_targets(leaves)):
        leaves = list(leaves)
        _commit.commit(
            leaves,
            entry.targets,
            lambda i: _checks.arg_path(cache.names, args, kwargs, i),
        )
        changed = True
    if layout.dynamic_of is not None:
        args, kwargs = layout.treedef.unflatten(layout.dynamic_of(leaves + [None]))
    elif changed:
        args, kwargs = layout.treedef.unflatten(leaves)
    return leaves, (dynamic_fun, kwargs, *args)


# JAX 0.10.2, CPU backend: several threads dispatching multi-device executables at once
# deadlock inside XLA (plain `jax.jit` too). Reproduction:
# tests/test_concurrency.py::test_threads_sharded (8 threads x 1000 calls: killed at its
# 90 s deadline on 0.10.2 without this lock; passes in 8 s on JAX 0.12.0.1 either way).
# Dispatch is asynchronous, so the lock serialises only the launch.
_cpu_dispatch_lock = threading.Lock()


def _serialize_dispatch(shardings: list) -> bool:
    return jax.default_backend() == "cpu" and any(
        isinstance(s, jax.sharding.Sharding) and len(s.device_set) > 1
        for s in shardings
    )


def _call(wrapper, args, kwargs, compiled=None):
    __tracebackhide__ = True
    cache: _Cache = wrapper._cache
    # Read by `eqx.error_if`'s stacks: one per decoration.
    __equinox_jit_id__ = wrapper._jit_id
    args, kwargs = _bind(cache, args, kwargs)
    leaves, treedef = jtu.tree_flatten((args, kwargs))
    if compiled is None:
        layout = cache.layouts.get((treedef, tuple(map(type, leaves))))
        entry = None if layout is None else layout.entries.get(layout.key(leaves))
        if entry is None:
            entry, leaves, dynamic = _compile(
                wrapper, cache, args, kwargs, leaves, treedef
            )
        else:
            leaves, dynamic = _prepare(wrapper, cache, entry, args, kwargs, leaves)
        run = entry.jitted
    else:
        entry = compiled._entry
        if (
            treedef != entry.layout.treedef
            or entry.layout.static_of(leaves) != entry.static
        ):
            raise TypeError(
                "This function was compiled for arguments of structure "
                f"{entry.layout.treedef} with static (non-array) leaves "
                f"{entry.static}, but was called with {treedef} and "
                f"{entry.layout.static_of(leaves)}. Lower and compile it again for "
                "these arguments."
            )
        leaves, dynamic = _prepare(wrapper, cache, entry, args, kwargs, leaves)
        run = compiled.compiled
    try:
        if entry.wait:
            out = _callbacks.call_and_wait(entry.wait, run, dynamic, __equinox_jit_id__)
        elif cache.filter_warning:
            with warnings.catch_warnings():
                warnings.filterwarnings(
                    "ignore", message="Some donated buffers were not usable"
                )
                out = run(*dynamic)
        elif entry.serialize:
            with _cpu_dispatch_lock:
                out = run(*dynamic)
        else:
            out = run(*dynamic)
    except eqx.EquinoxRuntimeError:
        raise
    except Exception:
        _checks.diagnose(
            cache.names, args, kwargs, leaves, entry.layout.dynamic, entry.targets
        )
        raise
    dynamic_out, static_out = out
    if static_out is None:
        return dynamic_out
    return hashable_combine(dynamic_out, static_out.value)


def _compile(wrapper, cache, args, kwargs, leaves, treedef, dynamic=is_array):
    """The slow path of a call (or a `.lower()`): makes the layout and the entry,
    places the inputs and traces, once per static part, under the cache's lock."""
    layout_key = (treedef, tuple(map(type, leaves)), dynamic)
    with cache.lock:
        layout = cache.layouts.get(
            layout_key if dynamic is not is_array else layout_key[:2]
        )
        if layout is None:
            layout = _Layout(cache, args, kwargs, leaves, treedef, dynamic)
        key = layout.key(leaves)
        entry = layout.entries.get(key)
        if entry is None:
            entry = _new_entry(wrapper, cache, layout, args, kwargs, leaves)
        leaves, dynamic_trees = _prepare(wrapper, cache, entry, args, kwargs, leaves)
        if entry.wait is None and not jax.config.jax_disable_jit:  # pyright: ignore
            with warnings.catch_warnings():
                warnings.filterwarnings(
                    "ignore", message="Some donated buffers were not usable"
                )
                if isinstance(entry.jitted, _ResolveRules):
                    entry.jitted = entry.jitted.trace(*dynamic_trees)
                traced = entry.jitted.trace(*dynamic_trees)
                # A function with callbacks is waited for, its callbacks guarded.
                entry.wait = _callbacks.has_callback(
                    traced.jaxpr.jaxpr
                ) and _callbacks.guard(entry.jitted, dynamic_trees)
            layout.entries[key] = entry
            cache.layouts[layout_key if dynamic is not is_array else layout_key[:2]] = (
                layout
            )
    return entry, leaves, dynamic_trees


#
# Ahead-of-time compilation.
#


class Compiled(Module):
    """The result of `filter_jit(f).lower(...).compile()`. Calling it makes the same
    call as `filter_jit(f)`, through the same checks, with this executable."""

    compiled: jax.stages.Compiled
    _wrapper: Any = field(static=True, repr=False)
    _entry: _Entry = field(static=True, repr=False)

    def __call__(self, /, *args, **kwargs):
        __tracebackhide__ = True
        return _call(self._wrapper, args, kwargs, self)

    def as_text(self) -> str | None:
        return self.compiled.as_text()

    @property
    def input_shardings(self) -> tuple[tuple, dict]:
        """The shardings of the array arguments, as `(args, kwargs)` in the structure of
        the bound arguments; `None` at non-array leaves."""
        (_, kwargs, *args), _ = self.compiled.input_shardings
        return tuple(args), kwargs

    @property
    def output_shardings(self) -> Any:
        """The shardings of the array outputs, in the structure of the output; non-array
        outputs appear as themselves."""
        dynamic, static = self.compiled.output_shardings
        return dynamic if static is None else hashable_combine(dynamic, static.value)


class Lowered(Module):
    """The result of `filter_jit(f).lower(...)`."""

    lowered: jax.stages.Lowered
    _wrapper: Any = field(static=True, repr=False)
    _entry: _Entry = field(static=True, repr=False)

    def as_text(self) -> str:
        return self.lowered.as_text()

    def compile(
        self, /, compiler_options: dict[str, str | bool] | None = None
    ) -> Compiled:
        compiled = self.lowered.compile(compiler_options=compiler_options)
        return Compiled(compiled, self._wrapper, self._entry)


#
# The public wrapper.
#


class _JitWrapper(Module):
    fn: str  # this attribute exists solely to give a nice repr
    _dynamic_fun: Any = field(repr=False)
    _static_fun: Any = field(static=True, repr=False)
    _cache: _Cache = field(static=True, repr=False)
    _jit_id: bytes = field(static=True, repr=False)

    @property
    def __wrapped__(self):
        return hashable_combine(self._dynamic_fun, self._static_fun)

    def __call__(self, /, *args, **kwargs):
        __tracebackhide__ = True
        try:
            return _call(self, args, kwargs)
        except eqx.EquinoxRuntimeError as e:
            e.__traceback__ = None
            raise

    def lower(self, /, *args, **kwargs) -> Lowered:
        """Lowers the function for the given arguments, ahead of time. Arrays may be
        replaced by `jax.ShapeDtypeStruct`s (optionally carrying a `sharding`)."""
        cache = self._cache
        args, kwargs = _bind(cache, args, kwargs)
        leaves, treedef = jtu.tree_flatten((args, kwargs))
        entry, _, dynamic = _compile(
            self, cache, args, kwargs, leaves, treedef, _is_array_or_struct
        )
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message="Some donated buffers were not usable"
            )
            lowered = entry.jitted.lower(*dynamic)
        return Lowered(lowered, self, entry)

    def __get__(self, instance, owner):
        del owner
        if instance is None:
            return self
        return Partial(self, instance)


@overload
def filter_jit(
    *,
    in_shardings: Any = _unset,
    out_shardings: Any = _unset,
    donate: _DonateMode = "none",
) -> Callable[[Callable[_P, _T]], Callable[_P, _T]]: ...


@overload
def filter_jit(
    fun: Callable[_P, _T],
    *,
    in_shardings: Any = _unset,
    out_shardings: Any = _unset,
    donate: _DonateMode = "none",
) -> Callable[_P, _T]: ...


def filter_jit(
    fun=_unset,
    *,
    in_shardings: Any = _unset,
    out_shardings: Any = _unset,
    donate: _DonateMode = "none",
):
    """An easier-to-use version of `jax.jit` that also takes shardings. All JAX and
    NumPy arrays are traced, and all other types are held static, exactly as in
    `equinox.filter_jit`; `in_shardings` and `out_shardings` are PyTree prefixes of the
    arguments and of the output, with non-array leaves ignored.

    **Arguments:**

    - `fun`: a pure function to JIT compile.
    - `in_shardings`: where the array arguments live. Either a single specification
        leaf, applied to every array of every argument (positional and keyword); or a
        tuple with one entry per positional parameter of `fun` (after binding the call
        to `fun`'s signature, so an argument passed by keyword gets the same entry as
        when passed by position), each entry a PyTree prefix of that argument.
        Keyword-only parameters and `**kwargs` are only addressed by the single-leaf
        form; with a tuple they are unspecified. Spec leaves are those of
        [`equinox_shard.filter_device_put`][]: `Sharding`, `jax.Device`, bare
        `PartitionSpec` (with `jax.set_mesh`), `None`, or a callable `leaf -> spec`.
        `None` (and any argument not covered) is "unspecified" to `jax.jit`: a committed
        array keeps its sharding, an uncommitted one is placed by `jax.jit`.
        Uncommitted JAX arrays with a specified sharding are committed to it before the
        call, so that `x = f(x)` compiles once.
    - `out_shardings`: a PyTree prefix of the output, in the same language, passed to
        `jax.jit`'s own `out_shardings` (so `.lower()`, `jax.eval_shape` and
        `Compiled.output_shardings` report it). Non-array outputs are returned as
        static values, untouched.
    - `donate`: as in `equinox.filter_jit`: `'all'`, `'all-except-first'`, `'warn'`,
        `'warn-except-first'` or `'none'` (the default). An array reachable twice in
        one call (tied weights, or one array in a donated and in a kept argument) is
        not donated, so the process never crashes and no kept array is deleted.

    **Returns:**

    The JIT'd version of `fun`. It has a `.lower(*args, **kwargs)` method for
    ahead-of-time compilation (arrays may be `jax.ShapeDtypeStruct`s), whose result
    has `.as_text()` and `.compile()`.

    **Raises:**

    At decoration, `ValueError`/`TypeError` for a malformed `in_shardings` (wrong
    number of entries, a dict at the top level, a bad spec leaf) or `donate`. At call
    time, before anything runs, errors that name the argument's key path (e.g.
    `model.layers[0].weight`): a specification that is not a prefix of its argument,
    a rank or divisibility mismatch, a bare `PartitionSpec` without a mesh, a deleted
    (already donated) array, or a committed argument whose sharding differs from its
    `in_shardings` entry.

    !!! example

        ```python
        mesh = jax.make_mesh((8,), ("data",))
        replicated = jax.NamedSharding(mesh, jax.P())
        batch = jax.NamedSharding(mesh, jax.P("data"))

        @eqxs.filter_jit(
            in_shardings=(replicated, replicated, batch),
            out_shardings=(replicated, replicated, None),
            donate="all-except-first",
        )
        def step(model, opt_state, xy):
            ...
            return model, opt_state, loss
        ```
    """
    if fun is _unset:
        return ft.partial(
            filter_jit,
            in_shardings=in_shardings,
            out_shardings=out_shardings,
            donate=donate,
        )
    dynamic_fun, static_fun = hashable_partition(fun)
    cache = _get_cache(fun, static_fun, donate, in_shardings, out_shardings)
    if not jtu.tree_leaves(dynamic_fun):
        dynamic_fun = None
    jit_wrapper = _JitWrapper(
        fn=cache.fun_names[1],
        _dynamic_fun=dynamic_fun,
        _static_fun=static_fun,
        _cache=cache,
        _jit_id=os.urandom(16),
    )
    return module_update_wrapper(jit_wrapper)
