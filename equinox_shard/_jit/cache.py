"""`filter_jit`'s caches: a `Cache` per decoration, an `ArgStructure` per argument
structure, an `Entry` (one `jax.jit`) per static part of the arguments."""

import collections as co
import functools as ft
import inspect
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox._caches
import jax._src.traceback_util as traceback_util
import jax.tree_util as jtu
from equinox import Module
from jax.tree_util import PyTreeDef

from .._arrays import (
    deleted_test,
    is_tracer,
)
from .._spec.language import (
    context_mesh,
    flatten_specs,
    key_names,
    needs_mesh,
    spread,
)
from .._spec.leaves import (
    is_rule,
    is_spec_leaf,
    may_be_own_leaf,
    PathRules,
    RulesUsage,
    unset,
)
from .donation import Donation
from .packing import getter, Packing


traceback_util.register_exclusion(__file__)


# A call's two keys, whose fields `explain_misses` names.


class StructureKey(NamedTuple):
    """What calls share to share an `ArgStructure` (`Cache.structures`)."""

    # Of the bound `(args, kwargs)`.
    treedef: PyTreeDef  # pyright: ignore[reportInvalidTypeForm]
    leaf_types: tuple
    # `.lower` also traces `jax.ShapeDtypeStruct`s.
    is_traced: Callable[[Any], bool]


class EntryKey(NamedTuple):
    """What calls share to share an `Entry`: one `jax.jit` (`ArgStructure.entries`)."""

    static: tuple
    # The shape and dtype of each leaf that rules see (RFC §13).
    avals: tuple
    # The context mesh, when a bare `PartitionSpec` or a rule resolves against it.
    mesh: Any


# The `StructureKey` fields `filter_jit`'s step 0 checks itself (the bound treedef,
# each leaf's type; `is_traced` is `is_array` on calls): with any other field, calls
# are looked up.
WARM_FIELDS = ("treedef", "leaf_types", "is_traced")

# `StructureKey(*key)` and `EntryKey(*key)` without their Python frame.
_structure_key = ft.partial(tuple.__new__, StructureKey)
_entry_key = ft.partial(tuple.__new__, EntryKey)


def look_up(call: "Call", treedef, is_traced) -> StructureKey:
    """A call's `StructureKey` (made here only), and its `ArgStructure` and `Entry`
    set on `call` (`None` on a miss)."""
    leaves = call.leaves
    key = _structure_key((treedef, tuple(map(type, leaves)), is_traced))
    structure = call.structure = call.cache.structures.get(key)
    try:
        call.entry = structure and structure.entries.get(
            structure.key_in_entries(leaves)
        )
    except Exception:  # a static leaf unhashable, or whose `==` fails: a miss names it
        call.entry = None
    return key


class Call:
    """One call, the value each step of the call path takes: its bound arguments and
    their leaves (as placed, once prepared), its `ArgStructure` and `Entry`, and what
    the dispatch launches, `run(*dynamic)`. `where(i)` names leaf `i` for errors."""

    __slots__ = (
        "cache",
        "fun",  # the function's arrays, in their mirror (`None` if it has none)
        "jit_id",  # read by `eqx.error_if`'s stacks: one per decoration
        "args",
        "kwargs",
        "leaves",
        "structure",
        "entry",
        "dynamic",
        "run",
    )

    def where(self, i: int) -> str:
        """The key path of leaf `i` of the bound `(args, kwargs)`."""
        path, _ = jtu.tree_flatten_with_path((self.args, self.kwargs))[0][i]
        return self.cache.path_name(path, (self.args, self.kwargs))


class Cache:
    """One decoration's configuration and compiled functions: `structures[StructureKey]`
    -> `ArgStructure`, whose `entries[EntryKey]` -> `Entry`."""

    def __init__(self, fun, donate, in_shardings, out_shardings):
        self.donation = Donation(donate)
        self.signature = signature = inspect.signature(fun)
        params = signature.parameters.values()
        positional = [p for p in params if p.kind <= p.POSITIONAL_OR_KEYWORD]
        by_kind = {p.kind: p.name for p in params}  # read for the variadic kinds only
        self.names = tuple(p.name for p in positional)
        self.var_name = var = by_kind.get(inspect.Parameter.VAR_POSITIONAL)
        taken = set(signature.parameters)
        self.fun_name = unique_name("fun", taken)
        kwargs_name = by_kind.get(inspect.Parameter.VAR_KEYWORD)
        self.kwargs_name = kwargs_name or unique_name("kwargs", taken)
        # The numbers of positional arguments that bind without `inspect`'s help.
        self.arity = range(
            sum(p.default is p.empty for p in positional),
            len(positional) + 1 if var is None else sys.maxsize,
        )
        self.fun_names, self.fun_source = _names_and_source(fun)
        self.in_leaves: list = []
        # Parameters the dict form names whose defaults are passed in when omitted.
        self.defaults: dict = {}
        # Keyword-only parameters' entries of the dict form (by parameter name).
        self.by_name: dict | None = None
        if type(in_shardings) is dict:
            in_shardings = self._by_name(in_shardings)
        self.in_shardings = in_shardings
        if in_shardings is not unset:
            # As `jax.jit(in_shardings=)`, a list is a tuple.
            per_parameter = type(in_shardings) in (tuple, list)
            self.in_leaves, treedef = flatten_specs(
                in_shardings,
                "in_shardings",
                self._spec_where if per_parameter else None,
                jit_in=True,
                own_leaves=per_parameter,  # an argument's own, checked per call
            )
            if treedef.num_nodes == 1 and treedef.num_leaves == 1:
                self.in_kind = "broadcast"
            elif per_parameter:
                self.in_kind = "positional"
                if var is None and len(in_shardings) != len(positional):
                    raise ValueError(
                        "`in_shardings` must be a single specification (applied to "
                        "every argument) or a tuple or list with one entry per "
                        f"positional parameter of `{self.fun_names[1]}`, which has "
                        f"{len(positional)} ({', '.join(self.names) or 'none'}); got "
                        f"{_count(len(in_shardings), 'entry', 'entries')}."
                    )
            else:
                raise TypeError(
                    "`in_shardings` must be a single specification (applied to every "
                    "argument), a tuple or list with one entry per positional "
                    "parameter, or a dict by parameter name; got a "
                    f"{type(in_shardings).__name__}. To give one "
                    "argument a PyTree of shardings, wrap it in a tuple: "
                    "`in_shardings=(spec,)`."
                )
        self.out_shardings = out_shardings
        out_leaves = []
        if out_shardings is not unset:
            out_leaves, _ = flatten_specs(
                out_shardings, "out_shardings", own_leaves=True
            )
        # Callables, path rules and the output's own leaves (`t1=10.0` in a spec tree
        # made by `jax.tree.map`) need the output: resolved from the first trace.
        self.out_rules = any(
            is_rule(x) or isinstance(x, PathRules) or may_be_own_leaf(x)
            for x in out_leaves
        )
        self.out_mesh = any(map(needs_mesh, out_leaves))
        self.lock = threading.Lock()
        self.clear()
        _live_caches.add(self)

    def _by_name(self, specs: dict) -> tuple:
        """The dict form, `{parameter name: entry}`: its tuple over the positional
        parameters (`None` where not named); keyword-only entries kept apart."""
        params = self.signature.parameters
        variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        names = [n for n, p in params.items() if p.kind not in variadic]
        for name in specs:
            if name not in names:
                raise ValueError(
                    f"`in_shardings` names {name!r}, which is not a parameter of "
                    f"`{self.fun_names[1]}` ({', '.join(names) or 'none'}); the dict "
                    "form takes parameter names (not `*args` or `**kwargs`). To give "
                    "one argument a dict of shardings, wrap it in a tuple: "
                    "`in_shardings=(spec,)`."
                )
        # A default is placed as if passed (as `jax.jit` would see it), not left as a
        # constant of the function: then every call binds, to pass it in.
        self.defaults = {
            k: params[k].default
            for k in specs
            if params[k].default is not params[k].empty
        }
        if self.defaults:
            self.arity = range(0)
        keyword_only = {k: v for k, v in specs.items() if k not in self.names}
        flatten_specs(keyword_only, "in_shardings", jit_in=True, own_leaves=True)
        self.by_name = keyword_only
        return tuple(specs.get(name) for name in self.names)

    def bind(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The call's arguments bound to the signature, with the `defaults`."""
        bound = self.signature.bind(*args, **kwargs)
        if self.defaults:
            # Every default, so that a named one after another left out stays
            # positional (where its entry of `in_shardings` is).
            bound.apply_defaults()
        return bound.args, bound.kwargs

    def _spec_where(self, path: tuple) -> str:
        """A leaf of per-parameter `in_shardings`, named as its parameter's leaves."""
        spec = "in_shardings" + jtu.keystr(path)
        if self.by_name is not None:  # the dict form
            spec = f"in_shardings[{self.names[path[0].idx]!r}]" + jtu.keystr(path[1:])
        return f"{self.positional(path[0].idx)}{jtu.keystr(path[1:])} (`{spec}`)"

    def positional(self, position: int) -> str:
        """Positional argument `position`'s name: its parameter's, or `xs[k]`."""
        if position < len(self.names):
            return self.names[position]
        if self.var_name is not None:
            return f"{self.var_name}[{position - len(self.names)}]"
        return f"args[{position}]"

    def path_name(self, path: tuple, tree: Any = None) -> str:
        """A key path into the bound `(args, kwargs)` (`tree`, to name `State` entries),
        from the parameter's name."""
        if len(path) < 2:
            return "the arguments"
        _, key, *rest = path  # `args[p]` or `kwargs[k]`
        if isinstance(key, jtu.SequenceKey):
            name = self.positional(key.idx)
        else:
            name = str(key.key if isinstance(key, jtu.DictKey) else key)
        if tree is None:
            return name + jtu.keystr(tuple(rest))
        return name + "".join(key_names(tree, path)[2:])

    def clear(self):
        with self.lock:
            self.structures: dict = {}
            self.entries: dict = {}
            self.packings: dict = {}
            # The last warm call's `entry._warm`, which `filter_jit`'s step 0 tries.
            self.warm: Any = None  # an `entry.Warm`
            # The calls that made entries, under `jax_explain_cache_misses`.
            self.seen: list = []


# Every live `Cache`, cleared by `eqx.clear_caches()` through Equinox's `cache_clears`.
_live_caches: weakref.WeakSet = weakref.WeakSet()


def _clear_caches() -> None:
    with _caches_lock:
        _recent_caches.clear()
    for cache in list(_live_caches):
        cache.clear()


equinox._caches.cache_clears.append(_clear_caches)


# Equal decorations share a `Cache` while alive and `_RECENT` after: no loop grows it.
_RECENT = 4
_shared_caches: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_recent_caches: co.OrderedDict = co.OrderedDict()
_caches_lock = threading.Lock()


def get_cache(fun, static_fun, donate, in_shardings, out_shardings) -> Cache:
    def spec_key(specs):
        if specs is unset:
            return None
        leaves, treedef = jtu.tree_flatten(specs, is_leaf=is_spec_leaf)
        return tuple(leaves), treedef

    key = (static_fun, donate, spec_key(in_shardings), spec_key(out_shardings))
    try:
        hash(key)
    except TypeError:  # unhashable: not shared
        return Cache(fun, donate, in_shardings, out_shardings)
    with _caches_lock:
        cache = _shared_caches.get(key)
        if cache is None:
            cache = Cache(fun, donate, in_shardings, out_shardings)
            _shared_caches[key] = cache
        _recent_caches[key] = cache
        _recent_caches.move_to_end(key)
        while len(_recent_caches) > _RECENT:
            _recent_caches.popitem(last=False)
    return cache


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def unique_name(name: str, taken: set) -> str:
    while name in taken:
        name = name + "_"
    return name


def _names_and_source(fun) -> tuple[tuple[str, str], Any]:
    """`fun`'s `(__name__, __qualname__)`, and the Python function whose source JAX's
    messages point at (or `None`), past `functools.partial` and `__wrapped__`."""
    while isinstance(fun, ft.partial) or (
        hasattr(fun, "__wrapped__") and not isinstance(fun, Module)
    ):
        fun = fun.func if isinstance(fun, ft.partial) else fun.__wrapped__
    try:
        names = fun.__name__, fun.__qualname__
    except AttributeError:
        names = type(fun).__name__, type(fun).__qualname__
    source = fun if hasattr(fun, "__code__") else getattr(type(fun), "__call__", None)
    return names, source if hasattr(source, "__code__") else None


# `StructureKey` fields the program ignores: NumPy and JAX leaves share a `jax.jit`.
_NOT_IN_PROGRAM = ("leaf_types", "is_traced")


class ArgStructure:
    """What depends only on the structure and leaf types of the bound arguments."""

    def __init__(self, call: Call, key: StructureKey):
        cache, args, leaves = call.cache, call.args, call.leaves
        self.structure_key = key
        treedef, is_traced = key.treedef, key.is_traced
        mask = tuple(map(is_traced, leaves))
        self.treedef = treedef
        self.traced_indices = tuple(i for i, m in enumerate(mask) if m)
        self.static_indices = tuple(i for i, m in enumerate(mask) if not m)
        self.static_of = getter(self.static_indices, key=True)
        # One `Packing` per traced leaves, as the entries: any packs for any entry.
        packing = cache.packings.get((treedef, mask))
        if packing is None:
            packing = cache.packings[treedef, mask] = Packing(call, mask)
        self.packing = packing
        self.donated = cache.donation.leaves(args, self.traced_indices)
        self.specs = _in_specs(call, is_traced)
        # What resolving the specs depends on: the leaves rules see, and the mesh.
        in_rules = tuple(i for i in self.traced_indices if is_rule(self.specs[i]))
        self.rules = self.traced_indices if cache.out_rules else in_rules
        self.needs_mesh = cache.out_mesh or any(map(needs_mesh, self.specs))
        # A call's key in `entries`: its `static` alone where the others are fixed.
        constant = {"avals": not self.rules, "mesh": not self.needs_mesh}
        self.key_in_entries = (
            self.static_of
            if all(constant.get(name, False) for name in EntryKey._fields[1:])
            else self.entry_key
        )
        self.deleted = deleted_test(leaves, getter(self.traced_indices))
        # Tracers (inside an outer trace): `jax.jit` is called, not an executable.
        self.has_tracers = any(is_tracer(leaves[i]) for i in self.traced_indices)
        # Any other `StructureKey` field, a new one too, keys the entries.
        shared = tuple(v for f, v in key._asdict().items() if f not in _NOT_IN_PROGRAM)
        self.entries = cache.entries.setdefault((*shared, mask), {})

    def entry_key(self, leaves: list) -> EntryKey:
        avals = tuple((leaves[i].shape, leaves[i].dtype) for i in self.rules)
        mesh = context_mesh(abstract_ok=True) if self.needs_mesh else None
        return _entry_key((self.static_of(leaves), avals, mesh))


def _in_specs(call: Call, is_traced) -> list:
    """One `in_shardings` leaf per leaf of the bound `(args, kwargs)`."""
    cache, args, kwargs, leaves = call.cache, call.args, call.kwargs, call.leaves
    if cache.in_shardings is unset:
        return [None] * len(leaves)
    if cache.in_kind == "broadcast":
        (spec,) = cache.in_leaves
        if not isinstance(spec, PathRules):
            return [spec] * len(leaves)
        # Path rules match paths within each argument, as under the tuple form.
        specs, named = (spec,) * len(args), sorted(kwargs)
    elif cache.by_name is not None:  # the dict form: unnamed parameters unspecified
        specs = cache.in_shardings + (None,) * max(0, len(args) - len(cache.names))
        named = sorted(kwargs)
    else:
        specs, named = cache.in_shardings, []
        if cache.var_name is not None and len(specs) != len(args):
            entries = _count(len(specs), "entry", "entries")
            given = _count(len(args), "positional argument", "positional arguments")
            raise ValueError(
                f"`in_shardings` has {entries} but the call has {given}: with "
                f"`*{cache.var_name}`, a tuple has one entry per positional argument "
                "of the call. For one specification of every argument, pass it "
                "alone: `in_shardings=spec`."
            )
    where = call.where
    groups = []
    for p, (spec, arg) in enumerate(zip(specs, args)):
        name = cache.positional(p)
        entry = repr(name) if cache.by_name is not None else p  # the dict form's key
        groups.append((f"in_shardings[{entry}]", spec, arg, name))
    if cache.by_name is None:
        groups += [("in_shardings", specs[0], kwargs[k], k) for k in named]
    else:
        by_name = cache.by_name
        groups += [
            (f"in_shardings[{k!r}]", by_name.get(k), kwargs[k], k) for k in named
        ]
    out = []
    usage = RulesUsage()  # strict rules: checked over all the arguments at once
    for name, spec, arg, arg_name in groups:
        at = lambda j, s=len(out): where(s + j)  # `j`: a leaf of this argument
        leaves_ = jtu.tree_leaves(arg)
        out.extend(spread(spec, arg, leaves_, name, arg_name, at, is_traced, usage))
    usage.check()
    return out + [None] * (len(leaves) - len(out))  # keyword arguments


def raise_if_unhashable(call: Call, static: tuple) -> None:
    """Raises naming the first `static` leaf that cannot be hashed."""
    for i in static:
        try:
            hash(call.leaves[i])
        except TypeError as e:
            raise ValueError(
                f"{call.where(i)}: a static (non-array) argument that is not hashable "
                f"({e}); static arguments key the cache of compiled functions, as in "
                "`equinox.filter_jit`, so each must be hashable."
            ) from None


def raise_if_incomparable(call: Call, static: tuple, entries) -> None:
    """Raises naming the first `static` leaf whose `==` with that of an entry fails."""
    for entry in entries:
        for i, other in zip(static, entry.static):
            x = call.leaves[i]
            if x is other:  # equal without `==`, as a dict finds it
                continue
            try:
                bool(x == other)
            except Exception as e:
                raise ValueError(
                    f"{call.where(i)}: a static (non-array) argument whose `==` raised "
                    f"({type(e).__name__}: {e}); static arguments key the cache of "
                    "compiled functions, as in `equinox.filter_jit`, so each must "
                    "compare to a `bool`."
                ) from e
