import collections as co
import functools as ft
import inspect
import logging
import operator
import os
import threading
import types
import warnings
import weakref
from collections.abc import Callable
from typing import Any, Literal, overload, TypeVar
from typing_extensions import ParamSpec

import equinox as eqx
import jax
import jax._src.traceback_util as traceback_util
import jax.core
import jax.tree_util as jtu
import numpy as np
from equinox import field, is_array, Module, module_update_wrapper, Partial

from . import _multiprocess
from ._sharding import (
    _array_impl_type,
    constrain_leaves,
    device_put_leaves,
    resolve_leaves,
)
from ._spec import (
    broadcast_specs,
    check,
    context_mesh,
    flatten_specs,
    is_rule,
    match_path_rules,
    PathRules,
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


#
# Static bookkeeping. None of these are PyTrees of arrays; the objects that end up in a
# `Module`'s static fields hash by identity, so that two wrappers around the same
# function (and configuration) compare equal and share their compiled functions.
#


def _hashable_partition(tree: Any) -> tuple[tuple, tuple]:
    leaves, treedef = jtu.tree_flatten(tree)
    dynamic = tuple(x if is_array(x) else None for x in leaves)
    static = tuple(None if is_array(x) else x for x in leaves)
    return dynamic, (static, treedef)


def _hashable_combine(dynamic: tuple, static: tuple) -> Any:
    static_leaves, treedef = static
    leaves = [d if s is None else s for d, s in zip(dynamic, static_leaves)]
    return jtu.tree_unflatten(treedef, leaves)


def _getter(indices: tuple[int, ...]) -> Callable[[Any], tuple]:
    # `operator.itemgetter` gathers at C speed; it returns a bare item for one index.
    if len(indices) == 0:
        return lambda leaves: ()
    if len(indices) == 1:
        (i,) = indices
        return lambda leaves: (leaves[i],)
    return operator.itemgetter(*indices)


class _OutStatic:
    """The non-array part of a traced function's output, returned from `jax.jit` as a
    leafless PyTree node so that each compiled executable carries its own."""

    __slots__ = ("treedef", "static_leaves", "gather")

    def __init__(self, treedef, static_leaves, positions):
        self.treedef = treedef
        if positions is None:  # every output leaf is an array
            self.static_leaves = ()
            self.gather = None
        else:
            # Output leaf `i` is element `order[i]` of `dynamic + static_values`, so
            # that `combine` gathers at C speed instead of looping in Python.
            static_values = tuple(x for x in static_leaves if x is not None)
            order = []
            n_dynamic = len(positions)
            dynamic_index = {p: k for k, p in enumerate(positions)}
            static_count = 0
            for i, x in enumerate(static_leaves):
                if i in dynamic_index:
                    order.append(dynamic_index[i])
                else:
                    order.append(n_dynamic + static_count)
                    static_count += 1
            self.static_leaves = static_values
            self.gather = _getter(tuple(order))

    def combine(self, dynamic: tuple) -> Any:
        if self.gather is None:
            return self.treedef.unflatten(dynamic)
        return self.treedef.unflatten(self.gather(dynamic + self.static_leaves))


jtu.register_static(_OutStatic)


class _Plan:
    """Everything about one call that depends only on the argument structure
    (treedef) and the leaf types: which leaves are traced, which are donated, and the
    specification that sits above each leaf."""

    __slots__ = (
        "treedef",
        "n_leaves",
        "mask",
        "donated",
        "kept",
        "get_donated",
        "get_kept",
        "get_static",
        "in_specs",
        "extra_indices",
        "needs_mesh",
        "keyed",
        "any_deleted",
        "entries",
        "arg_names",
        "n_args",
    )


class _Entry:
    """One compiled function: a `jax.jit` over the flat array leaves, for one value of
    the static leaves."""

    __slots__ = (
        "jitted",
        "in_todo",
        "commit",
        "sync",
        "filter_warning",
        "donated",
        "kept",
        "fast",
        "serialize",
    )


class _Table:
    """Plans and compiled entries shared by all wrappers of equal functions with equal
    configuration."""

    def __init__(self, config, names, static_fun):
        self.config = config
        self.names = names
        # Whether the function being JIT'd (e.g. a Module) has array leaves of its own.
        self.fun_has_arrays = any(x is None for x in static_fun[0])
        self.plans: dict = {}
        self.entries: dict = {}
        self.lock = threading.RLock()
        # Identifies this table's frames in `eqx.error_if`'s stacks.
        self.id = os.urandom(16)


# user function (or a default key) -> {(names, config, static_fun): _Table}
_tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_tables_lock = threading.Lock()


def _default_table_key():  # A weakref-able sentinel.
    assert False


def _strip_wrapped(fun):
    while True:
        if isinstance(fun, ft.partial):
            fun = fun.func
        elif hasattr(fun, "__wrapped__") and not isinstance(fun, Module):
            fun = fun.__wrapped__
        else:
            return fun


def _fn_names(fun) -> tuple[str, str]:
    fun = _strip_wrapped(fun)
    try:
        return fun.__name__, fun.__qualname__
    except AttributeError:
        return type(fun).__name__, type(fun).__qualname__


def _get_table(fun, config, static_fun) -> _Table:
    user_fn = _strip_wrapped(fun)
    weak_key = user_fn if type(user_fn) is types.FunctionType else _default_table_key
    key = (_fn_names(fun), config, static_fun)
    try:
        hash(key)
    except TypeError:
        # An unhashable specification or static function: no sharing.
        return _Table(config, key[0], static_fun)
    with _tables_lock:
        try:
            by_key = _tables[weak_key]
        except KeyError:
            by_key = _tables[weak_key] = {}
        try:
            return by_key[key]
        except KeyError:
            table = by_key[key] = _Table(config, key[0], static_fun)
            return table


class _Config:
    """The immutable configuration of one `filter_jit` decoration."""

    __slots__ = (
        "donate_first",
        "donate_rest",
        "filter_warning",
        "in_shardings",
        "in_leaves",
        "in_def",
        "in_kind",
        "out_shardings",
        "signature",
        "positional_names",
        "var_positional",
        "min_args",
        "max_args",
        "_key",
    )

    def __eq__(self, other):
        return type(other) is _Config and self._key == other._key

    def __hash__(self):
        return hash(self._key)


def _make_config(fun, donate, in_shardings, out_shardings) -> _Config:
    try:
        donate_first, donate_rest, filter_warning = _DONATE_MODES[donate]
    except (KeyError, TypeError):
        raise ValueError(
            "`filter_jit(..., donate=...)` must be one of 'all', 'all-except-first', "
            f"'warn', 'warn-except-first', or 'none'; got {donate!r}."
        ) from None
    signature = inspect.signature(fun)
    positional = [
        p
        for p in signature.parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    var_positional = any(
        p.kind is p.VAR_POSITIONAL for p in signature.parameters.values()
    )
    config = _Config()
    config.donate_first = donate_first
    config.donate_rest = donate_rest
    config.filter_warning = filter_warning
    config.signature = signature
    config.positional_names = tuple(p.name for p in positional)
    config.var_positional = var_positional
    config.min_args = sum(p.default is p.empty for p in positional)
    config.max_args = float("inf") if var_positional else len(positional)
    config.in_shardings = in_shardings
    config.out_shardings = out_shardings
    if in_shardings is _unset:
        config.in_kind = None
        config.in_leaves = config.in_def = None
    else:
        leaves, treedef = flatten_specs(in_shardings, "in_shardings")
        config.in_leaves = leaves
        config.in_def = treedef
        if treedef.num_nodes == 1 and treedef.num_leaves == 1:
            config.in_kind = "broadcast"
        elif type(in_shardings) in (tuple, list):
            config.in_kind = "positional"
            if not var_positional and len(in_shardings) != len(positional):
                raise ValueError(
                    "`in_shardings` must be a single specification (applied to every "
                    "argument) or a tuple with one entry per positional parameter of "
                    f"`{_fn_names(fun)[1]}`, which has {len(positional)} "
                    f"({', '.join(config.positional_names) or 'none'}); got "
                    f"{len(in_shardings)} entries."
                )
        else:
            raise TypeError(
                "`in_shardings` must be a single specification (applied to every "
                "argument) or a tuple with one entry per positional parameter; got "
                f"a {type(in_shardings).__name__}. To give one argument a PyTree of "
                "shardings, wrap it in a tuple: `in_shardings=(spec,)`."
            )
    if out_shardings is not _unset:
        flatten_specs(out_shardings, "out_shardings")
    try:
        in_key = (
            None if in_shardings is _unset else (tuple(config.in_leaves), config.in_def)  # pyright: ignore
        )
        out_key = (
            None
            if out_shardings is _unset
            else jtu.tree_flatten(out_shardings, is_leaf=lambda x: x is None)
        )
        if out_key is not None:
            out_key = (tuple(out_key[0]), out_key[1])
        config._key = (donate, in_key, out_key, signature)
        hash(config._key)
    except TypeError:
        config._key = (object(),)
    return config


#
# Paths, in terms of the user's arguments.
#


def _arg_path(config: _Config, args: tuple, kwargs: dict, index: int) -> str:
    path, _ = jtu.tree_flatten_with_path((args, kwargs))[0][index]
    group, key, *rest = path
    if group.idx == 0:  # pyright: ignore
        position = key.idx  # pyright: ignore
        if position < len(config.positional_names):
            name = config.positional_names[position]
        else:
            name = f"args[{position}]"
    else:
        name = key.key  # pyright: ignore
    return name + jtu.keystr(tuple(rest))


def _arg_name(config: _Config, position: int) -> str:
    if position < len(config.positional_names):
        return config.positional_names[position]
    return f"args[{position}]"


def _in_specs(config: _Config, args: tuple, kwargs: dict, n_leaves: int) -> list:
    """One spec leaf per leaf of `(args, kwargs)`."""
    if config.in_kind is None:
        return [None] * n_leaves
    if config.in_kind == "broadcast":
        (spec,) = config.in_leaves  # pyright: ignore
        if not isinstance(spec, PathRules):
            return [spec] * n_leaves
        # Path rules match paths within each argument, as under the tuple form.
        in_shardings = (spec,) * len(args)
        named = {name: spec for name in kwargs}
    else:
        in_shardings = config.in_shardings
        named = {}
    if config.var_positional and len(in_shardings) != len(args):
        raise ValueError(
            f"`in_shardings` has {len(in_shardings)} entries but the call has "
            f"{len(args)} positional arguments."
        )
    out = []
    groups = [
        (p, arg, in_shardings[p], _arg_name(config, p)) for p, arg in enumerate(args)
    ]
    groups += [(name, kwargs[name], spec, name) for name, spec in sorted(named.items())]
    for position, arg, spec, arg_name in groups:
        spec_leaves, spec_def = flatten_specs(spec, f"in_shardings[{position}]")
        arg_leaves = jtu.tree_leaves(arg)
        per_leaf = broadcast_specs(
            spec_leaves,
            spec_def,
            spec,
            arg,
            len(arg_leaves),
            f"in_shardings[{position}]",
            arg_name,
        )
        start = len(out)
        out.extend(
            match_path_rules(
                per_leaf,
                spec_leaves,
                spec_def,
                arg,
                arg_leaves,
                lambda j, s=start: _arg_path(config, args, kwargs, s + j),
                is_array,
            )
        )
    out.extend([None] * (n_leaves - len(out)))  # keyword-only and **kwargs
    return out


def _make_plan(table, config, args, kwargs, leaves, treedef, dynamic) -> _Plan:
    plan = _Plan()
    mask = tuple(dynamic(x) for x in leaves)
    n_first = len(jtu.tree_leaves(args[0])) if args else 0
    plan.treedef = treedef
    plan.n_leaves = len(leaves)
    plan.mask = mask
    plan.donated = tuple(
        i
        for i, m in enumerate(mask)
        if m and (config.donate_first if i < n_first else config.donate_rest)
    )
    donated = set(plan.donated)
    plan.kept = tuple(i for i, m in enumerate(mask) if m and i not in donated)
    plan.get_donated = _getter(plan.donated)
    plan.get_kept = _getter(plan.kept)
    plan.get_static = _getter(tuple(i for i, m in enumerate(mask) if not m))
    plan.in_specs = _in_specs(config, args, kwargs, len(leaves))
    plan.extra_indices = tuple(
        i for i, (m, s) in enumerate(zip(mask, plan.in_specs)) if m and is_rule(s)
    )
    plan.needs_mesh = any(
        isinstance(s, jax.sharding.PartitionSpec) for s in plan.in_specs
    )
    plan.keyed = bool(plan.extra_indices) or plan.needs_mesh
    array_impl = _array_impl_type()
    if dynamic is is_array and all(
        type(x) is array_impl for x, m in zip(leaves, mask) if m
    ):
        # `map` over the unbound method runs at C speed (~27ns per leaf). (Not for
        # `.lower()`: a `Compiled` may be called with other array types.)
        plan.any_deleted = lambda xs: any(map(array_impl.is_deleted, xs))
    else:
        plan.any_deleted = lambda xs: any(
            type(x) is array_impl and x.is_deleted() for x in xs
        )
    with table.lock:
        plan.entries = table.entries.setdefault((treedef, mask), {})
    return plan


def _extra_key(plan: _Plan, leaves: list) -> tuple:
    avals = tuple((leaves[i].shape, leaves[i].dtype) for i in plan.extra_indices)
    mesh = context_mesh(abstract_ok=True) if plan.needs_mesh else None
    return avals, mesh


#
# Building the jitted function for one entry.
#


def _walk_callbacks(jaxpr) -> bool:
    for eqn in jaxpr.eqns:
        if "callback" in eqn.primitive.name:
            return True
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns") and _walk_callbacks(inner):
                    return True
    return False


_committed = operator.attrgetter("_committed")


class _Commit:
    """Commits uncommitted JAX arrays to their `in_shardings` before the call, so that
    `jax.jit` sees committed inputs every time and compiles once (it otherwise traces
    uncommitted and committed inputs separately).

    Where a sharding spans several processes (`jax.distributed`), NumPy arrays are
    committed too, and both are placed as by `filter_device_put`: checked to be the
    same on every process, naming the argument's key path if not."""

    __slots__ = (
        "donated",
        "kept",
        "multiprocess",
        "get_donated",
        "get_kept",
        "leaf_indices",
    )

    def __init__(self, donated, kept, leaf_indices):
        self.donated = donated
        self.kept = kept
        # (donated leaf indices, kept leaf indices) of the call: for key paths only.
        self.leaf_indices = leaf_indices
        self.multiprocess = any(not s.is_fully_addressable for _, s in donated + kept)
        self.get_donated = _getter(tuple(p for p, _ in donated))
        self.get_kept = _getter(tuple(p for p, _ in kept))

    def __call__(
        self, donated: tuple, kept: tuple, config: "_Config", args, kwargs
    ) -> tuple[tuple, tuple]:
        # The common case, at C speed: every specified leaf is committed already.
        try:
            if all(map(_committed, self.get_donated(donated))) and all(
                map(_committed, self.get_kept(kept))
            ):
                return donated, kept
        except AttributeError:  # e.g. a NumPy array: no `_committed`
            pass
        array_impl = _array_impl_type()
        multiprocess = self.multiprocess
        out = []
        for g, (group, specified) in enumerate(
            ((donated, self.donated), (kept, self.kept))
        ):
            fix = [
                (p, s)
                for p, s in specified
                if (type(group[p]) is array_impl and not group[p]._committed)
                or (multiprocess and isinstance(group[p], (np.ndarray, np.generic)))
            ]
            if fix:
                group = list(group)
                indices = [p for p, _ in fix]
                targets = [s for _, s in fix]
                if multiprocess:
                    leaf_index = self.leaf_indices[g]
                    indices, targets = _multiprocess.place_host_local(
                        group,
                        indices,
                        targets,
                        lambda p: _arg_path(config, args, kwargs, leaf_index[p]),
                    )
                if indices:
                    # As with `jax.jit`'s own resharding, a donated argument's buffer
                    # may be shared with this copy (e.g. device 0 of a replicated
                    # sharding).
                    moved = jax.device_put([group[p] for p in indices], targets)
                    for p, x in zip(indices, moved):
                        group[p] = x
                group = tuple(group)
            out.append(group)
        return out[0], out[1]


def _make_entry(w, plan: _Plan, args, kwargs, leaves) -> _Entry:
    config: _Config = w._table.config
    entry = _Entry()
    entry.filter_warning = config.filter_warning
    entry.donated = plan.donated
    entry.kept = plan.kept

    # Resolve and check `in_shardings` for each traced leaf, naming argument paths.
    in_todo = []
    for i in plan.donated + plan.kept:
        spec = plan.in_specs[i]
        if spec is None:
            continue
        where = lambda i=i: _arg_path(config, args, kwargs, i)
        sharding = resolve(spec, leaves[i], where, abstract_ok=True)
        if sharding is not None:
            check(leaves[i].shape, sharding, where)
            in_todo.append((i, sharding))
    entry.in_todo = in_todo
    by_index = dict(in_todo)
    donated_shardings = tuple(by_index.get(i) for i in plan.donated)
    kept_shardings = tuple(by_index.get(i) for i in plan.kept)
    specified_donated = [(p, s) for p, s in enumerate(donated_shardings) if s]
    specified_kept = [(p, s) for p, s in enumerate(kept_shardings) if s]
    if specified_donated or specified_kept:
        entry.commit = _Commit(
            specified_donated, specified_kept, (plan.donated, plan.kept)
        )
    else:
        entry.commit = None

    treedef = plan.treedef
    # The static leaves of *this* call: a plan is shared by all static values.
    static_template = tuple(None if m else x for m, x in zip(plan.mask, leaves))
    donated_index = plan.donated
    kept_index = plan.kept
    static_fun = w._static_fun
    out_shardings = config.out_shardings

    def fun_wrapped(dynamic_fun, donated, kept):
        full = list(static_template)
        for i, x in zip(donated_index, donated):
            full[i] = x
        for i, x in zip(kept_index, kept):
            full[i] = x
        if in_todo and jax.config.jax_disable_jit:  # pyright: ignore
            # `jax.jit` ignores `in_shardings` under `disable_jit`; we place anyway.
            device_put_leaves(jtu.tree_unflatten(treedef, full), full, in_todo, "args")
        call_args, call_kwargs = jtu.tree_unflatten(treedef, full)
        fun = _hashable_combine(dynamic_fun, static_fun)
        out = fun(*call_args, **call_kwargs)
        out_leaves, out_def = jtu.tree_flatten(out)
        if out_shardings is not _unset:
            todo = resolve_leaves(
                out, out_leaves, out_shardings, "out_shardings", "out", abstract_ok=True
            )
            if todo:
                if jax.config.jax_disable_jit:  # pyright: ignore
                    device_put_leaves(out, out_leaves, todo, "out")
                else:
                    constrain_leaves(out, out_leaves, todo, "out")
        positions = tuple(i for i, x in enumerate(out_leaves) if is_array(x))
        dynamic_out = tuple(out_leaves[i] for i in positions)
        if len(positions) == len(out_leaves):
            out_static = _OutStatic(out_def, None, None)
        else:
            static_leaves = tuple(None if is_array(x) else x for x in out_leaves)
            out_static = _OutStatic(out_def, static_leaves, positions)
        return dynamic_out, out_static

    fun_name, fun_qualname = w._table.names
    fun_wrapped.__name__ = fun_name
    fun_wrapped.__qualname__ = fun_qualname
    jit_kwargs = {}
    if config.in_kind is not None:
        jit_kwargs["in_shardings"] = (None, donated_shardings, kept_shardings)
    donate_argnums = (0, 1) if config.donate_rest else (1,)
    entry.jitted = jax.jit(fun_wrapped, donate_argnums=donate_argnums, **jit_kwargs)
    entry.sync = False
    entry.fast = False
    entry.serialize = _serialize_dispatch(
        [s for _, s in in_todo]
        + [getattr(leaves[i], "sharding", None) for i in plan.donated + plan.kept]
    )
    return entry


def _check_sync(entry: _Entry, dynamic_fun, donated, kept) -> None:
    """Equinox's runtime errors (`eqx.error_if`) are `pure_callback`s that raise. Only
    functions that contain a callback are waited for, so that everything else keeps
    JAX's asynchronous dispatch. Those run with their callbacks guarded (see
    `_callbacks`): a raising callback would otherwise hang, then abort, a computation
    that spans several devices."""
    from . import _callbacks  # Here, not at the top: only functions with callbacks.

    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="Some donated buffers were not usable"
        )
        traced = entry.jitted.trace(dynamic_fun, donated, kept)
        if _walk_callbacks(traced.jaxpr.jaxpr):
            args = (dynamic_fun, donated, kept)
            entry.sync = _callbacks.guard(entry.jitted, args)
        else:
            entry.sync = False


#
# The call path.
#


def _bind(config: _Config, args, kwargs):
    bound = config.signature.bind(*args, **kwargs)
    return bound.args, bound.kwargs


def _raise_deleted(config: _Config, plan: _Plan, args, kwargs, leaves) -> None:
    for i in plan.donated + plan.kept:
        x = leaves[i]
        if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
            if x.is_deleted():
                raise RuntimeError(
                    f"{_arg_path(config, args, kwargs, i)}: this array has been "
                    "deleted (was it donated to an earlier call?)."
                )


def _diagnose(table: _Table, plan: _Plan, entry: _Entry, args, kwargs, leaves) -> None:
    """Called only after `jax.jit` raised: re-raise with the user's key path where we
    can name the culprit."""
    config: _Config = table.config
    _raise_deleted(config, plan, args, kwargs, leaves)
    for i, sharding in entry.in_todo:
        x = leaves[i]
        where = lambda i=i: _arg_path(config, args, kwargs, i)
        check(x.shape, sharding, where)
        if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
            if x.committed and not x.sharding.is_equivalent_to(sharding, x.ndim):
                raise ValueError(
                    f"{where()}: this argument is committed to {x.sharding}, but "
                    f"`in_shardings` asks for {sharding}. `filter_jit` does not move "
                    "committed arrays implicitly; move it first with "
                    "`equinox_shard.filter_device_put`, or give `None` for it in "
                    "`in_shardings` to accept its current sharding."
                )


# On the CPU backend, several threads dispatching multi-device executables at once can
# deadlock inside XLA (every thread waits in `PjRtCpuLoadedExecutable::Execute`; plain
# `jax.jit` from 8 threads hangs too: tests/test_concurrency.py). Dispatch is
# asynchronous, so holding a lock around it costs ~50ns and serialises only the launch.
_cpu_dispatch_lock = threading.Lock()


def _serialize_dispatch(shardings: list) -> bool:
    if jax.default_backend() != "cpu":
        return False
    return any(
        isinstance(s, jax.sharding.Sharding) and len(s.device_set) > 1
        for s in shardings
    )


def _raise_deleted_fun(dynamic_fun: tuple) -> None:
    raise RuntimeError(
        "An array of the function being JIT'd has been deleted (was it donated to an "
        "earlier call?)."
    )


def _demotions(
    donated: tuple,
    kept: tuple,
    dynamic_fun: tuple,
    table: _Table,
    plan: _Plan,
    args,
    kwargs,
):
    """The same buffer must never be donated whilst it is passed again in the same
    call (donated twice, or donated and kept): XLA then crashes on multi-device arrays.
    Returns `None` if no buffer is reachable twice (the common case, checked at C
    speed), else the leaf indices to keep rather than donate."""
    config: _Config = table.config
    ids = set(map(id, donated))
    fun_ids = {id(x) for x in dynamic_fun if x is not None}
    if (
        len(ids) == len(donated)
        and ids.isdisjoint(map(id, kept))
        and (not fun_ids or ids.isdisjoint(fun_ids))
        and not (
            config.donate_rest and fun_ids and not fun_ids.isdisjoint(map(id, kept))
        )
    ):
        return None
    if config.donate_rest and fun_ids:
        for i, x in zip(plan.donated + plan.kept, donated + kept):
            if id(x) in fun_ids:
                raise ValueError(
                    f"{_arg_path(config, args, kwargs, i)}: this array is also part "
                    "of the function being JIT'd, whose arrays are donated; an array "
                    "cannot be both donated and passed again."
                )
    # A buffer passed more than once is not donated at all: donating any one of its
    # occurrences would invalidate the others within the same execution.
    counts = co.Counter(map(id, donated + kept))
    for x in fun_ids:
        counts[x] += 1
    demote = [i for i, x in zip(plan.donated, donated) if counts[id(x)] > 1]
    return tuple(demote)


def _guard(
    table: _Table, plan: _Plan, args, kwargs, leaves, donated, kept, dynamic_fun
) -> tuple | None:
    """The checks that every call makes before anything runs, whether through
    `filter_jit` or a `Compiled` object. Raises, naming the key path, if an input was
    deleted (XLA segfaults on a deleted multi-device input); returns the leaf indices
    of donated inputs whose buffer is reachable twice and must be kept, or `None`."""
    if plan.any_deleted(donated) or plan.any_deleted(kept):
        _raise_deleted(table.config, plan, args, kwargs, leaves)
    if not donated and not (table.config.donate_rest and table.fun_has_arrays):
        return None
    array_impl = _array_impl_type()
    if any(type(x) is array_impl and x.is_deleted() for x in dynamic_fun):
        _raise_deleted_fun(dynamic_fun)
    return _demotions(donated, kept, dynamic_fun, table, plan, args, kwargs)


def _aliased_entry(w, plan: _Plan, demote: tuple, key, args, kwargs, leaves):
    table = w._table
    alias_key = ("aliased", key, demote)
    entry = plan.entries.get(alias_key)
    if entry is None:
        with table.lock:
            entry = plan.entries.get(alias_key)
            if entry is None:
                sub = _Plan()
                for name in _Plan.__slots__:
                    if hasattr(plan, name):
                        setattr(sub, name, getattr(plan, name))
                demoted = set(demote)
                sub.donated = tuple(i for i in plan.donated if i not in demoted)
                sub.kept = tuple(sorted(plan.kept + demote))
                entry = _make_entry(w, sub, args, kwargs, leaves)
                entry.fast = False
                if not jax.config.jax_disable_jit:  # pyright: ignore
                    # Like any entry: wait for (and guard) its callbacks.
                    donated = tuple(leaves[i] for i in entry.donated)
                    kept = tuple(leaves[i] for i in entry.kept)
                    if entry.commit is not None:
                        config = table.config
                        donated, kept = entry.commit(
                            donated, kept, config, args, kwargs
                        )
                    _check_sync(entry, _getattr(w, "_dynamic_fun"), donated, kept)
                plan.entries[alias_key] = entry
    donated = tuple(leaves[i] for i in entry.donated)
    kept = tuple(leaves[i] for i in entry.kept)
    return entry, donated, kept


try:
    _JaxRuntimeError = jax.errors.JaxRuntimeError  # pyright: ignore
except AttributeError:  # pragma: no cover
    _JaxRuntimeError = RuntimeError


class _FilterCallback(logging.Filterer):
    def filter(self, record: logging.LogRecord):  # pyright: ignore
        return not (
            record.name == "jax._src.callback"
            and record.getMessage() == "jax.pure_callback failed"
        )


def _equinox_runtime_error(
    e: BaseException, jit_id: bytes, info: Any = None
) -> Exception | None:
    """Equinox's error for `e` if it is (XLA's wrapping of) Equinox's internal one.
    `info`: its `(message, stack)` as a guarded callback recorded them."""
    import equinox._jit as eqx_jit  # Equinox's runtime-error channel.

    if info is None:
        info = getattr(eqx_jit, "last_error_info", None)
        if info is None or "_EquinoxRuntimeError: " not in str(e):
            return None
    elif type(e).__name__ != "_EquinoxRuntimeError":
        return None
    msg, stack = info
    pieces = []
    for id_or_str in stack:
        if type(id_or_str) is str:
            pieces.append(id_or_str)
        elif id_or_str == jit_id:
            break
    return eqx.EquinoxRuntimeError(
        eqx_jit._on_error_msg.format(msg=msg, stack="".join(reversed(pieces)))
    )


def _run_sync(guarded, jitted, args: tuple, jit_id: bytes):
    """Runs a function that contains callbacks and waits for it; raises what they
    raised. `guarded`: a `_callbacks.GuardedCall` for `jitted`."""
    __tracebackhide__ = True
    if guarded.usable(args):
        out, error, info = guarded(args)
        if error is None:
            return out
        equinox_error = _equinox_runtime_error(error, jit_id, info)
        if equinox_error is not None:
            raise equinox_error from None
        raise _JaxRuntimeError(
            f"A callback raised {type(error).__name__}: {error}"
        ) from error
    # Traced (an outer `jax.jit`, `vmap`, `grad`) or under `jax.disable_jit`.
    callback_logger = logging.getLogger("jax._src.callback")
    log_filter = _FilterCallback()
    callback_logger.addFilter(log_filter)
    try:
        out = jitted(*args)
        jax.block_until_ready(out[0])
        return out
    except (_JaxRuntimeError, ValueError) as e:
        error = _equinox_runtime_error(e, jit_id)
        if error is None:
            raise
        raise error from None
    finally:
        callback_logger.removeFilter(log_filter)


# `eqx.Module.__getattribute__` runs in Python (it wraps bound methods): reading four
# fields through it cost ~1µs per call, a third of `jax.jit`'s whole single-leaf
# dispatch (3.4µs at N=1, measured with cProfile and `time.thread_time`). Our fields
# hold no methods, so `object.__getattribute__` returns the same objects at C speed.
_getattr = object.__getattribute__


def _lookup(
    w, table: _Table, args, kwargs, leaves, treedef
) -> tuple[_Plan, Any, _Entry]:
    """The slow path of a call: build the plan and/or the compiled entry."""
    config: _Config = table.config
    plan_key = (treedef, tuple(map(type, leaves)))
    plan = table.plans.get(plan_key)
    if plan is None:
        plan = _make_plan(table, config, args, kwargs, leaves, treedef, is_array)
        with table.lock:
            plan = table.plans.setdefault(plan_key, plan)
    key = plan.get_static(leaves)
    if plan.keyed:
        key = (key, _extra_key(plan, leaves))
    entry = plan.entries.get(key)
    if entry is None:
        with table.lock:
            entry = plan.entries.get(key)
            if entry is None:
                entry = _make_entry(w, plan, args, kwargs, leaves)
                if jax.config.jax_disable_jit:  # pyright: ignore
                    # Nothing is compiled (or waited for): don't cache it.
                    return plan, key, entry
                donated = plan.get_donated(leaves)
                kept = plan.get_kept(leaves)
                if entry.commit is not None:
                    donated, kept = entry.commit(donated, kept, config, args, kwargs)
                _check_sync(entry, _getattr(w, "_dynamic_fun"), donated, kept)
                entry.fast = not (
                    entry.sync
                    or entry.filter_warning
                    or entry.commit is not None
                    or plan.donated
                    or (config.donate_rest and table.fun_has_arrays)
                )
                plan.entries[key] = entry
    return plan, key, entry


def _call(w, args, kwargs):
    __tracebackhide__ = True
    table: _Table = _getattr(w, "_table")
    __equinox_jit_id__ = table.id  # noqa: F841 - read by `eqx.error_if`'s stacks.
    config = table.config
    if kwargs or not (config.min_args <= len(args) <= config.max_args):
        args, kwargs = _bind(config, args, kwargs)
    leaves, treedef = jtu.tree_flatten((args, kwargs))
    plan = table.plans.get((treedef, tuple(map(type, leaves))))
    entry = key = None
    if plan is not None:
        key = plan.get_static(leaves)
        if plan.keyed:
            key = (key, _extra_key(plan, leaves))
        entry = plan.entries.get(key)
    if plan is None or entry is None:
        plan, key, entry = _lookup(w, table, args, kwargs, leaves, treedef)
    donated = plan.get_donated(leaves)
    kept = plan.get_kept(leaves)
    dynamic_fun = _getattr(w, "_dynamic_fun")
    demote = _guard(table, plan, args, kwargs, leaves, donated, kept, dynamic_fun)
    if entry.fast:
        # The hot path: no donation, no commits, no callbacks to wait for.
        try:
            if entry.serialize:
                with _cpu_dispatch_lock:
                    out = entry.jitted(dynamic_fun, donated, kept)
            else:
                out = entry.jitted(dynamic_fun, donated, kept)
        except Exception:
            _diagnose(table, plan, entry, args, kwargs, leaves)
            raise
        return out[1].combine(out[0])
    if demote:
        entry, donated, kept = _aliased_entry(
            w, plan, demote, key, args, kwargs, leaves
        )
    if entry.commit is not None:
        donated, kept = entry.commit(donated, kept, config, args, kwargs)
    jitted = entry.jitted
    try:
        if entry.sync:
            out = _run_sync(entry.sync, jitted, (dynamic_fun, donated, kept), table.id)
        elif entry.filter_warning:
            with warnings.catch_warnings():
                warnings.filterwarnings(
                    "ignore", message="Some donated buffers were not usable"
                )
                if entry.serialize:
                    with _cpu_dispatch_lock:
                        out = jitted(dynamic_fun, donated, kept)
                else:
                    out = jitted(dynamic_fun, donated, kept)
        elif entry.serialize:
            with _cpu_dispatch_lock:
                out = jitted(dynamic_fun, donated, kept)
        else:
            out = jitted(dynamic_fun, donated, kept)
    except eqx.EquinoxRuntimeError as e:
        e.__traceback__ = None
        raise
    except Exception:
        _diagnose(table, plan, entry, args, kwargs, leaves)
        raise
    return out[1].combine(out[0])


#
# Ahead-of-time compilation.
#


def _is_array_or_struct(x) -> bool:
    return is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


class Compiled(Module):
    """The result of `filter_jit(f).lower(...).compile()`: call it with arguments of the
    same structure, shapes and static values as were lowered. Each call makes the
    checks of a `filter_jit` call before it runs: a deleted input raises, naming its key
    path, and a donated buffer that is reachable twice is kept (the executable gets a
    copy of it)."""

    compiled: jax.stages.Compiled
    _wrapper: Any = field(static=True, repr=False)
    _statics: tuple = field(static=True, repr=False)
    _plan: _Plan = field(static=True, repr=False)
    _entry: _Entry = field(static=True, repr=False)

    def __call__(self, /, *args, **kwargs):
        w = self._wrapper
        table: _Table = w._table
        config = table.config
        plan = self._plan
        if kwargs or not (config.min_args <= len(args) <= config.max_args):
            args, kwargs = _bind(config, args, kwargs)
        leaves, treedef = jtu.tree_flatten((args, kwargs))
        statics = tuple(x for x in leaves if not is_array(x))
        if treedef != plan.treedef or statics != self._statics:
            raise TypeError(
                "This function was compiled for arguments of structure "
                f"{plan.treedef} with static (non-array) leaves {self._statics}, but "
                f"was called with {treedef} and {statics}. Lower and compile it again "
                "for these arguments."
            )
        donated = plan.get_donated(leaves)
        kept = plan.get_kept(leaves)
        dynamic_fun = w._dynamic_fun
        demote = _guard(table, plan, args, kwargs, leaves, donated, kept, dynamic_fun)
        if demote:
            # The executable donates these: it gets private copies, and the caller's
            # buffer is kept, as `filter_jit` keeps it.
            # (NumPy inputs are copied onto the device by every call anyway.)
            positions = [
                p
                for p in map(plan.donated.index, demote)
                if isinstance(donated[p], jax.Array)
            ]
            copies = jax.device_put(
                [donated[p] for p in positions],
                [donated[p].sharding for p in positions],
                may_alias=False,
            )
            donated = list(donated)
            for p, x in zip(positions, copies):
                donated[p] = x
            donated = tuple(donated)
        entry = self._entry
        if entry.sync:
            # Callbacks that may raise: run guarded, as a `filter_jit` call would.
            args = (dynamic_fun, donated, kept)
            dynamic_out, out_static = _run_sync(
                entry.sync, entry.jitted, args, table.id
            )
        else:
            dynamic_out, out_static = self.compiled(dynamic_fun, donated, kept)
        return out_static.combine(dynamic_out)

    def as_text(self) -> str | None:
        return self.compiled.as_text()

    @property
    def input_shardings(self) -> tuple[tuple, dict]:
        """The shardings of the array arguments, as `(args, kwargs)` in the structure
        of the (bound) arguments; `None` at non-array leaves."""
        (_, donated, kept), _ = self.compiled.input_shardings
        plan = self._plan
        leaves: list = [None] * plan.treedef.num_leaves
        for i, sharding in zip(plan.donated, donated):
            leaves[i] = sharding
        for i, sharding in zip(plan.kept, kept):
            leaves[i] = sharding
        return jtu.tree_unflatten(plan.treedef, leaves)

    @property
    def output_shardings(self) -> Any:
        """The shardings of the array outputs, in the structure of the output; non-array
        outputs appear as themselves."""
        dynamic, out_static = self.compiled.output_shardings
        return out_static.combine(dynamic)


class Lowered(Module):
    """The result of `filter_jit(f).lower(...)`."""

    lowered: jax.stages.Lowered
    _wrapper: Any = field(static=True, repr=False)
    _statics: tuple = field(static=True, repr=False)
    _plan: _Plan = field(static=True, repr=False)
    _entry: _Entry = field(static=True, repr=False)

    def as_text(self) -> str:
        return self.lowered.as_text()

    def compile(
        self, /, compiler_options: dict[str, str | bool] | None = None
    ) -> Compiled:
        compiled = self.lowered.compile(compiler_options=compiler_options)
        return Compiled(compiled, self._wrapper, self._statics, self._plan, self._entry)


def _lower(w, args, kwargs) -> Lowered:
    table: _Table = _getattr(w, "_table")
    config = table.config
    if kwargs or not (config.min_args <= len(args) <= config.max_args):
        args, kwargs = _bind(config, args, kwargs)
    leaves, treedef = jtu.tree_flatten((args, kwargs))
    plan = _make_plan(table, config, args, kwargs, leaves, treedef, _is_array_or_struct)
    entry = _make_entry(w, plan, args, kwargs, leaves)
    lower_args = (
        _getattr(w, "_dynamic_fun"),
        plan.get_donated(leaves),
        plan.get_kept(leaves),
    )
    lowered = entry.jitted.lower(*lower_args)
    if not jax.config.jax_disable_jit:  # pyright: ignore
        _check_sync(entry, *lower_args)
    statics = tuple(x for x, m in zip(leaves, plan.mask) if not m)
    return Lowered(lowered, w, statics, plan, entry)


#
# The public wrapper.
#


class _JitWrapper(Module):
    fn: str  # this attribute exists solely to give a nice repr
    _dynamic_fun: tuple = field(repr=False)
    _static_fun: Any = field(static=True, repr=False)
    _table: _Table = field(static=True, repr=False)
    _table_id: bytes = field(static=True, repr=False)

    @property
    def __wrapped__(self):
        return _hashable_combine(self._dynamic_fun, self._static_fun)

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
        return _lower(self, args, kwargs)

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
    - `out_shardings`: a PyTree prefix of the output, in the same language. Each array
        output is constrained (at the end of the traced function) with the same
        machinery as [`equinox_shard.filter_shard`][]:
        `jax.lax.with_sharding_constraint` on Auto axes, `jax.sharding.reshard` on
        Explicit axes. Non-array outputs are returned as static values, untouched.
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
        mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
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
    config = _make_config(fun, donate, in_shardings, out_shardings)
    _, name = _fn_names(fun)
    dynamic_fun, static_fun = _hashable_partition(fun)
    table = _get_table(fun, config, static_fun)
    jit_wrapper = _JitWrapper(
        fn=name,
        _dynamic_fun=dynamic_fun,
        _static_fun=static_fun,
        _table=table,
        _table_id=table.id,
    )
    return module_update_wrapper(jit_wrapper)
