"""An `Entry` of `filter_jit`'s cache, built in one place (`build_entry`), and what each
call's inputs go through before it (`prepare`). `jax.jit` moves uncommitted and NumPy
inputs itself (RFC §6); we move only what it refuses."""

import functools as ft
import operator
from collections.abc import Callable
from itertools import compress, repeat
from typing import Any, NamedTuple

import jax
import jax._src.traceback_util as traceback_util
import jax.tree_util as jtu
import numpy as np
from jax.sharding import AxisType, NamedSharding, Sharding

from .._arrays import (
    in_default_memory,
    is_committed,
    is_concrete,
    is_tracer,
    is_value,
    on_abstract_mesh,
    raise_if_deleted,
    raise_if_fun_deleted,
    raise_if_not_jax_type,
)
from .._placement import is_placed, place
from .._spec.kinds import is_auto, kind_of, sharding_of
from .._spec.language import check_shapes, context_mesh, for_jax, resolve, resolve_each
from .._spec.leaves import is_spec_leaf, unset
from . import callbacks, launch
from .cache import ArgStructure, Call, WARM_FIELDS
from .packing import getter, mirror
from .traced_body import in_body, ResolveRules, static_out_shardings, traced_function


traceback_util.register_exclusion(__file__)


class Entry:
    """One compiled function: a `jax.jit` for one static part of the arguments, and its
    `dispatch` (`launch.stack`)."""

    __slots__ = (
        "structure",
        "static",
        "targets",
        "get_targets",
        "shardings",  # the `Sharding` per target
        "jax_moves_inputs",  # whether `jax.jit` moves uncommitted and NumPy inputs
        "donates",
        "keep",  # `donation.Donation.keeper`'s, where the entry donates
        "packs_only",  # nothing placed, nothing donated: `prepare` only packs
        "checks_deleted",  # whether `prepare` looks for deleted inputs, not the launch
        "typed",  # a `Typed` where calls with uncommitted inputs run it, else `None`
        "explicit",  # the leaves whose targets are on Explicit axes
        "places_uncommitted",  # whether uncommitted and NumPy inputs are ours to place
        "jitted",
        "guards",  # a program with host callbacks: its `callbacks.Guards`, else `None`
        "dispatch",
        "warm",  # `_warm`'s, for `filter_jit`'s fast path, or `None`
    )


def build_entry(call: Call, static_fun, watch: Callable | None = None) -> Entry:
    """The entry for `call`, in four steps: targets, `jax.jit`, trace, dispatch (with
    `watch`'s layer if given); `call` is prepared for it (`prepare`)."""
    cache, structure, where = call.cache, call.structure, call.where
    args, kwargs, leaves = call.args, call.kwargs, call.leaves
    raise_if_not_jax_type(leaves, structure.traced_indices, where)
    formats = _targets(structure, leaves, where)
    auto = _auto_layouts(formats, leaves, where)
    targets = [(i, sharding_of(s)) for i, s in formats]
    entry = call.entry = Entry()
    entry.structure = structure
    entry.static = structure.static_of(leaves)
    entry.targets = targets
    # Last first: a batch, often uncommitted, is usually last, so `all_placed` stops.
    entry.get_targets = getter(tuple(i for i, _ in reversed(targets)))
    # Where `jax.jit` moves uncommitted and NumPy inputs itself.
    entry.jax_moves_inputs = all(
        isinstance(f, Sharding)
        and in_default_memory(f)
        and (on_abstract_mesh(f) or f.is_fully_addressable)  # abstract: in a trace
        for _, f in formats
    )
    entry.shardings = tuple(s for _, s in reversed(targets))
    donation = cache.donation
    entry.donates = donation.donates(structure.donated, call.fun, len(args))
    entry.keep = entry.donates and donation.keeper(call, targets)
    entry.packs_only = not entry.donates and not targets
    entry.checks_deleted = not entry.donates
    entry.places_uncommitted = False
    entry.jitted = _jit(call, static_fun, formats)
    casts = _casts(structure, targets) if entry.jax_moves_inputs else []
    entry.typed = Typed(entry, casts, donation) if casts and auto is None else None
    entry.explicit = frozenset(
        structure.traced_indices[k]
        for k, s in casts
        if AxisType.Explicit in s.mesh.axis_types
    )
    prepare(call)
    run = guards = None
    if not jax.config.jax_disable_jit:
        run, guards = _trace(call)
        if entry.places_uncommitted:  # placed after all (see `_trace`)
            call.args, call.kwargs, call.leaves = args, kwargs, leaves
            prepare(call)
    entry.guards = guards
    if auto is not None:
        entry.jitted = AutoLayouts(entry.jitted, auto)
    shardings = [s for _, s in targets]
    shardings += [
        getattr(call.leaves[i], "sharding", None) for i in structure.traced_indices
    ]
    serialized = launch.serialize_dispatch(shardings)
    # XLA crashes on a deleted multi-device input: a launch under `dispatch_lock` looks
    # there, as an input donated by another thread's launch is deleted by then.
    entry.checks_deleted = not (entry.donates or serialized)
    layers = [launch.paced] if serialized and entry.donates else []
    if guards is not None:
        layers.append(ft.partial(callbacks.waiting, guards))
    if watch is not None:
        layers.append(watch(call))
    if entry.donates:
        first = donation.launch(call.fun, structure.packing.fun_at)
    else:
        first = launch.paced_serialized if serialized else launch.plain
    entry.dispatch = launch.stack(first, layers)
    call.run = entry.jitted if run is None else run
    entry.warm = _warm(call)
    return entry


class Warm(NamedTuple):
    """What `filter_jit`'s step 0 reads of an entry (`_warm`)."""

    treedef: Any
    traced_of: Callable  # leaves -> the traced ones
    static_of: Callable  # leaves -> the static ones
    types: tuple  # the static leaves' types
    static_hash: int  # as the look-up's key: a static leaf changed in place is a miss
    is_deleted: Callable | None  # of the one `jax.Array` type; `None`: NumPy
    run: Callable  # the entry's `jax.jit`
    entry: Any
    typed: Any  # the `Typed` that runs uncommitted inputs, or `None`
    placed: tuple | None  # the targets, in order, where `run` takes inputs as they are
    packs: tuple | None  # `Packing`'s getters and makers, or `None`: passed as they are
    serialized: bool  # launched as `launch.paced_serialized` (several CPU devices)


def _warm(call: Call) -> Warm | None:
    """What a later call needs to run this entry without a look-up or `prepare`, given
    the same argument structure, static part and leaf types (`filter_jit`'s step 0).
    Where every traced leaf is NumPy or of one `jax.Array` type (whose `is_deleted`
    checks both), nothing is donated, the launch is plain or `paced_serialized`
    (`launch.paced_run`), and preparing is packing alone (no targets), or every traced
    leaf has a target and either is on it (`PLACED`: the entry's `jax.jit` runs the
    call) or `jax.jit` would move each (`MOVES`: `Typed` runs it): step 0 checks."""
    entry, structure = call.entry, call.structure
    packing = structure.packing
    traced = structure.traced_indices
    serialized = entry.dispatch is launch.paced_serialized
    if not (
        not entry.donates
        and (entry.dispatch is None and entry.checks_deleted or serialized)
        and not packing.variadic
        and structure.key_in_entries is structure.static_of
        and structure.structure_key._fields == WARM_FIELDS
        and not structure.has_tracers
        and not jax.config.jax_disable_jit
    ):
        return None
    if entry.packs_only and call.run is entry.jitted:
        placed = None
    elif tuple(i for i, _ in entry.targets) == tuple(traced):
        placed = tuple(s for _, s in entry.targets)  # `all_placed`'s, in their order
    else:
        return None
    # The call's own types: `prepare` may have placed NumPy leaves of `call.leaves`.
    leaf_types = structure.structure_key.leaf_types
    types = {leaf_types[i] for i in traced}
    if len(types) != 1:
        return None
    (array_type,) = types
    if array_type is np.ndarray:  # never deleted, never committed: moved by `jax.jit`
        is_deleted = None
    elif issubclass(array_type, jax.Array):  # not a tracer: `has_tracers` is false
        is_deleted = array_type.is_deleted
    else:
        return None
    return Warm(
        structure.treedef,
        getter(traced),
        structure.static_of,
        tuple(map(type, entry.static)),
        hash(entry.static),
        is_deleted,
        entry.jitted,
        entry,
        entry.typed,
        placed,
        # How the traced leaves are packed, where they are not passed as they are.
        None if packing.trivial else (packing.gets, packing.makes),
        serialized,
    )


# The reads of step 0's test for a call that the entry's `jax.jit` takes as it is
# (`all_placed`), or that `Typed` runs (`jit_takes`'s `MOVES`).
get_sharding = operator.attrgetter("sharding")
get_committed = operator.attrgetter("committed")
get_weak_type = operator.attrgetter("aval.weak_type")


def _targets(structure: ArgStructure, leaves: list, where) -> list[tuple[int, Any]]:
    """`(i, spec leaf)` for each traced leaf that `in_shardings` places, checked."""
    resolver = ft.partial(resolve, abstract_ok=True)
    targets = resolve_each(
        structure.specs, leaves, structure.traced_indices, where, resolver
    )
    check_shapes(leaves, targets, where)
    for i, sharding in targets:
        kind = kind_of(sharding)
        if kind is not None and kind.jit_in_refused:
            raise TypeError(
                f"{where(i)}: `in_shardings` cannot hold a {kind.name} "
                f"({sharding}): {kind.jit_in_hint}."
            )
    # One `jax.jit` call takes inputs on one set of devices: said by their names.
    first = None
    for i, target in targets:
        sharding = sharding_of(target)
        if sharding is None or on_abstract_mesh(sharding):
            continue
        if first is None:
            first = (i, sharding.device_set)
        elif sharding.device_set != first[1]:
            ids = lambda d: sorted(x.id for x in d)
            raise ValueError(
                f"{where(first[0])} and {where(i)}: `in_shardings` places them on "
                f"different devices ({ids(first[1])} and {ids(sharding.device_set)}), "
                "but the inputs of one call must share one set of devices."
            )
    return targets


def _trace(call: Call) -> tuple:
    """Traces the entry's `jax.jit` for the call's inputs. Returns what this call runs
    (`None`: `jitted`) and the `callbacks.Guards` or `None`; where the entry places
    uncommitted inputs now (`places_uncommitted`), the call is prepared again."""
    entry, structure, donation = call.entry, call.structure, call.cache.donation
    jitted = entry.jitted
    # Traced for the types of committed inputs, which those `typed` runs take.
    at, moved = call.dynamic, False
    if entry.typed is not None and not structure.has_tracers:
        at, moved = entry.typed.types(call.dynamic)
    with donation.tracing():
        if isinstance(jitted, ResolveRules):
            jitted = entry.jitted = jitted.trace(*at)
        if not callbacks.has_callback(jitted.trace(*at).jaxpr.jaxpr):
            return (entry.typed if moved else None), None
    entry.typed = None
    if moved:
        # Traced for committed types: the guarded program is given placed inputs.
        entry.jax_moves_inputs = False
        entry.places_uncommitted = True
    argnums = donation.argnums(structure.packing.positions, len(call.args))
    return None, callbacks.Guards(jitted, argnums)


def _casts(structure: ArgStructure, targets) -> list[tuple[int, Any]]:
    """`(k, sharding)` for each traced leaf `k` whose target is on a mesh, where an
    uncommitted input's type lacks the mesh (`jax.jit` compiles it apart on Auto axes,
    and on Explicit axes traces it unsharded)."""
    position = {i: k for k, i in enumerate(structure.traced_indices)}
    return [
        (position[i], sharding)
        for i, sharding in targets
        if isinstance(sharding, NamedSharding)
        and not sharding.mesh.empty
        and i in position
    ]


class Typed:
    """Runs calls with uncommitted inputs for targets on a mesh through the executable
    of their committed types, so that the function sees the types `in_shardings` gives
    (on Explicit axes) and `x = f(x)` compiles once (RFC §6)."""

    __slots__ = ("entry", "casts", "donation", "compiled", "explicit", "others")

    def __init__(self, entry: Entry, casts: list, donation):
        self.entry = entry
        self.casts = casts
        self.donation = donation
        self.compiled: Any = None
        self.explicit = any(AxisType.Explicit in s.mesh.axis_types for _, s in casts)
        # The executables for other shapes, dtypes or formats of committed inputs.
        self.others: dict = {}

    def types(self, dynamic: tuple) -> tuple[tuple, bool]:
        """`dynamic` with uncommitted leaves as their committed types; whether any."""
        # `jax.jit`'s type of it: a NumPy float64 is float32 without x64.
        typed = lambda x, s: jax.ShapeDtypeStruct(
            x.shape, jax.typeof(x).dtype, sharding=s
        )
        return self._cast(dynamic, typed)

    def _cast(self, dynamic: tuple, cast: Callable) -> tuple[tuple, bool]:
        """`dynamic` with each uncommitted leaf `cast` to its target; whether any."""
        packing = self.entry.structure.packing
        leaves = packing.unpack(dynamic)
        # An executable of one weak type runs the other's, committed or not: `jax.jit`.
        if any(getattr(x, "weak_type", False) for x in leaves):
            return dynamic, False
        moved = False
        for k, sharding in self.casts:
            x = leaves[k]
            if is_value(x) and not is_committed(x):
                leaves[k] = cast(x, sharding)
                moved = True
        args, kwargs = packing.treedef.unflatten(leaves)
        return packing.slots(dynamic[packing.fun_at], args, kwargs), moved

    def rerun(self, dynamic: tuple) -> Any:
        """After its executable raised: under `jax.debug_nans` or `jax.debug_infs` the
        call through `jax.jit`, placed as typed, which re-runs the function de-optimized
        and names the primitive (the executable raises JAX's internal error); else the
        error is raised again."""
        if not (jax.config.jax_debug_nans or jax.config.jax_debug_infs):
            raise  # noqa: PLE0704 - called in an `except` block, re-raises its error
        placed, _ = self._cast(dynamic, jax.device_put)
        return self.entry.jitted(*placed)

    def __call__(self, *dynamic):
        compiled = self.compiled
        if jax.config.jax_disable_jit:
            # The function runs as it is (`jax.jit` runs it); no executable is called.
            return self.entry.jitted(*dynamic)
        if compiled is not None:
            try:
                return compiled(*dynamic)
            except (TypeError, ValueError):  # refused before it runs
                leaves = jtu.tree_leaves(dynamic)
                if any(map(is_tracer, leaves)):
                    return self.entry.jitted(*dynamic)
                types = lambda avals: [(a.shape, a.dtype) for a in avals]
                avals = jtu.tree_leaves(compiled.in_avals)
                if types(map(jax.typeof, leaves)) == types(avals):
                    # Its types, but a committed input on another sharding or layout.
                    if not self.explicit:  # the same program for any input: `jax.jit`
                        return self.entry.jitted(*dynamic)
                    return self._other(dynamic, leaves)
                # Other shapes: theirs runs, and is tried first from now on.
                return self._other(dynamic, leaves, first=True)
            except Exception:
                return self.rerun(dynamic)
        leaves = jtu.tree_leaves(dynamic)
        if any(map(is_tracer, leaves)):
            return self.entry.jitted(*dynamic)
        return self._other(dynamic, leaves, first=True)

    def _other(self, dynamic: tuple, leaves: list, first: bool = False):
        """Runs a call through the executable compiled for its inputs' shapes, dtypes
        and committed formats, kept (a few) for the next calls; `first`: tried first."""
        key = tuple(
            # A typed PRNG key has no `format`.
            (
                x.shape,
                jax.typeof(x).dtype,
                is_committed(x) and getattr(x, "format", None),
            )
            for x in leaves
            if is_value(x)
        )
        compiled = self.others.get(key)
        if compiled is None:
            compiled = self._compile(dynamic)
            if len(self.others) >= _OTHERS:
                self.others.clear()  # no loop grows it
            self.others[key] = compiled
        if first:
            self.compiled = compiled
        try:
            return compiled(*dynamic)
        except Exception:
            return self.rerun(dynamic)

    def _compile(self, dynamic: tuple) -> Any:
        at, _ = self.types(dynamic)
        with self.donation.tracing():
            return self.entry.jitted.lower(*at).compile()


# The most executables a `Typed` keeps for other shapes or formats of its inputs.
_OTHERS = 8


def all_placed(values, expected: tuple) -> bool:
    """Whether every value is a `jax.Array` whose sharding equals its target in
    `expected`, at C speed (upstream/jax-reports/jit-committed-device-order)."""
    try:
        return all(map(operator.eq, map(getattr, values, _SHARD), expected))
    except Exception:  # NumPy; a tracer without one
        return False


def jit_takes(values, expected: tuple) -> int:
    """Whether `jax.jit` takes every value as it is for its target in `expected`:
    `PLACED` (all there, or committed where `is_placed` says they stand for it),
    `MOVES` (those, and it moves the uncommitted others itself), or `0`. At C speed
    where all are there (`all_placed`)."""
    try:
        if all(map(operator.eq, map(getattr, values, _SHARD, _NONE), expected)):
            return PLACED
        off_values, off_expected = values, expected  # a model never placed
        if getattr(values[-1], "committed", False):
            # Beside a placed model (a fresh batch): one pass finds the few off target.
            off = list(map(operator.ne, map(getattr, values, _SHARD, _NONE), expected))
            off_values = list(compress(values, off))
            off_expected = compress(expected, off)
        committed = list(map(getattr, off_values, _COMMITTED, _FALSE))
        pairs = (compress(off_values, committed), compress(off_expected, committed))
        if not all(map(is_placed, *pairs)):
            return 0
        if all(committed):
            return PLACED
        # Weak types are `place`'s: `Typed` runs either as the other.
        if any(map(getattr, map(getattr, values, _AVAL, _NONE), _WEAK, _FALSE)):
            return 0
        return MOVES
    except Exception:  # a tracer: `place` leaves it to the enclosing call
        return 0


PLACED, MOVES = 1, 2  # `jit_takes`'s answers (both true)
_FALSE = repeat(False)
_NONE = repeat(None)
_AVAL = repeat("aval")
_COMMITTED = repeat("committed")
_SHARD = repeat("sharding")
_WEAK = repeat("weak_type")


def prepare(call: Call) -> None:
    """A call's checks and placements before `jax.jit`: sets its `leaves` as placed,
    the `dynamic` trees to call and what to call them with, `run` (`Entry.jitted` or
    `Typed`)."""
    entry, structure, leaves = call.entry, call.structure, call.leaves
    # One call looks at the inputs: where `jax.jit` moves inputs, `jit_takes` alone.
    takes = jit_takes if entry.jax_moves_inputs else all_placed
    ready = entry.packs_only or takes(entry.get_targets(leaves), entry.shardings)
    deleted = entry.checks_deleted and structure.deleted(leaves)
    if ready and not (deleted or entry.donates):  # nothing to check, donate or place
        call.dynamic = structure.packing.arguments(call)
        call.run = entry.jitted
        if ready != MOVES:
            return
        if not entry.explicit:
            # Inside an outer trace (tracers) there is no executable to call.
            if entry.typed is not None and not structure.has_tracers:
                call.run = entry.typed
            return
        if _typed_runs(entry, leaves):
            call.run = entry.typed
            return
        ready = 0  # `jax.jit` would trace them unsharded: placed by us
    if deleted:
        raise_if_deleted(leaves, structure.traced_indices, call.where)
    if entry.donates:  # its private copies are where the originals are
        call.leaves = entry.keep(call)
        if ready != PLACED and entry.jax_moves_inputs:
            ready = jit_takes(entry.get_targets(call.leaves), entry.shardings)
    if ready == MOVES and entry.explicit and not _typed_runs(entry, call.leaves):
        ready = 0  # `jax.jit` would trace them unsharded: placed by us
    if not ready:
        call.leaves = list(call.leaves)
        try:
            _place_inputs(call)
        except Exception as error:
            # The entry was checked for the shapes of the call that made it.
            try:
                diagnose(call)
            except Exception as named:
                if str(named) == str(error):  # `place` named it already: say it once
                    raise error from None
                raise
            raise
    packing = structure.packing
    if packing.trivial and call.leaves is not leaves:
        call.args, call.kwargs = structure.treedef.unflatten(call.leaves)
    call.dynamic = packing.arguments(call)
    # Inside an outer trace (tracers) there is no executable to call.
    typed = ready == MOVES and entry.typed is not None and not structure.has_tracers
    call.run = entry.typed if typed else entry.jitted


def _typed_runs(entry: Entry, leaves: list) -> bool:
    """Whether `Typed` runs a call whose uncommitted inputs `jax.jit` would move: not
    inside an outer trace, nor beside a weak type (its executable runs either type)."""
    return (
        entry.typed is not None
        and not entry.structure.has_tracers
        and not any(
            getattr(leaves[i], "weak_type", False)
            for i in entry.structure.traced_indices
        )
    )


def _place_inputs(call: Call) -> None:
    """`place`s the inputs that `jax.jit` would refuse, or trace unsharded (uncommitted
    inputs for Explicit axes, where `Typed` does not run the call), in `call.leaves`."""
    entry, leaves = call.entry, call.leaves
    targets = []
    for i, s in entry.targets:
        if on_abstract_mesh(s):  # inside a transform: `jax.jit` places the others
            s = on_its_mesh(leaves[i], s)
        if s is not None:
            targets.append((i, s))
    multiprocess = any(not s.is_fully_addressable for _, s in targets)
    if entry.jax_moves_inputs:
        explicit = entry.explicit
        value = lambda x, i: is_value(x) if i in explicit else is_committed(x)
    else:
        moved = is_value if multiprocess or entry.places_uncommitted else is_concrete
        value = lambda x, i: moved(x)
    todo = [(i, s) for i, s in targets if value(leaves[i], i)]
    donated = call.structure.donated
    may_alias = call.cache.donation.may_alias(leaves, todo, donated)
    place(leaves, todo, call.where, may_alias=may_alias)


def diagnose(call: Call) -> None:
    """After `jax.jit` raised: raises our own error if we can name the culprit."""
    leaves, traced, where = call.leaves, call.entry.structure.traced_indices, call.where
    raise_if_deleted(leaves, traced, where)
    raise_if_not_jax_type(leaves, traced, where)
    raise_if_fun_deleted(call.cache.fun_name, call.fun)
    check_shapes(leaves, call.entry.targets, where)
    for i, target in call.entry.targets:
        x = leaves[i]
        if not on_abstract_mesh(target):
            continue
        # Resolved inside a transform, where no concrete mesh is known to move it.
        if is_committed(x) and on_its_mesh(x, target) is None:
            at = f"committed to {x.sharding}, off the mesh of"
        elif is_tracer(x) and _refused(x, target):  # its value is (`jax.grad`'s)
            at = "traced, and its value committed elsewhere than"
        else:
            continue
        raise ValueError(
            f"{where(i)}: {at} its `in_shardings` entry {target.spec}. Inside a "
            "transform (`jax.grad`, `jax.vmap`, ...) that entry is only on the "
            "abstract mesh of `jax.set_mesh`, where nothing can be moved: place it "
            "before the transform, with `eqxs.filter_device_put`."
        )


def _refused(x: Any, target: Any) -> bool:
    """Whether `jax.jit` refuses the traced `x` for `target` (asked of it alone)."""
    try:
        jax.jit(lambda a: a, in_shardings=for_jax(target))(x)
    except ValueError:
        return True
    return False


def on_its_mesh(x: Any, target: Any) -> Any:
    """`target`, resolved on an abstract mesh (inside a transform such as `jax.grad`),
    on the concrete mesh of the committed array `x`, if `x` is on that mesh."""
    mesh = getattr(x.sharding, "mesh", None) if is_committed(x) else None
    if isinstance(mesh, jax.sharding.Mesh) and mesh.abstract_mesh == target.mesh:
        return NamedSharding(mesh, target.spec, memory_kind=target.memory_kind)
    return None


def _auto_layouts(targets, leaves, where) -> str | None:
    """Raises if an array is passed for a `Layout.AUTO`; else the message calls raise
    until compiled (`AutoLayouts`)."""
    auto = [i for i, s in targets if is_auto(s)]
    if not auto:
        return None
    message = lambda i: (
        f"{where(i)}: `in_shardings` gives it a `Format` with `Layout.AUTO`, which the "
        "compiler chooses when the function is lowered, so no array can be passed "
        "before then. Lower and compile first (`compiled = f.lower(*structs)"
        ".compile()`), place the arguments as `compiled.input_formats` says "
        "(`eqxs.filter_device_put`), and call `compiled` or `f`."
    )
    for i in auto:
        if is_value(leaves[i]):
            raise ValueError(message(i))
    return message(auto[0])


class AutoLayouts:
    """The `jax.jit` of an entry with `Layout.AUTO`: called only through its latest
    `Lowered.compile()`; until then a call raises `message`."""

    def __init__(self, jitted, message: str):
        self.jitted = jitted
        self.message = message
        self.compiled = None
        self.trace, self.lower = jitted.trace, jitted.lower

    def __call__(self, *args):
        if any(map(is_tracer, jtu.tree_leaves(args))):
            # Inside an outer trace the compiler chooses the layout, as for `jax.jit`.
            return self.jitted(*args)
        compiled = self.compiled
        if compiled is None:
            raise ValueError(self.message)
        return compiled(*args)


def _jit(call: Call, static_fun, targets) -> Any:
    """The `jax.jit` of an entry (a `ResolveRules` for rules in `out_shardings`)."""
    cache, structure, leaves = call.cache, call.structure, call.leaves
    jit_kwargs: dict = {}
    if cache.in_shardings is not unset:
        shardings: list = [None] * len(leaves)
        for i, sharding in targets:
            shardings[i] = for_jax(sharding)
        jit_kwargs["in_shardings"] = structure.packing.pack(shardings)
    positions = structure.packing.positions
    jit_kwargs["donate_argnums"] = cache.donation.argnums(positions, len(call.args))
    out_specs = cache.out_shardings
    if out_specs is not unset:
        out_specs = static_out_shardings(out_specs)
        if not cache.out_rules:
            given = jtu.tree_map(
                lambda s: None if in_body(s) else s, out_specs, is_leaf=is_spec_leaf
            )
            jit_kwargs["out_shardings"] = (mirror(given, is_leaf=is_spec_leaf), None)
    # The call's mesh, concrete outside a trace (inside, only the abstract one).
    mesh = context_mesh(abstract_ok=True) if cache.out_rules else None
    make = ft.partial(
        traced_function, cache, static_fun, structure, leaves, targets, mesh
    )
    if cache.out_rules:
        return ResolveRules(make, out_specs, jit_kwargs)
    return jax.jit(make(out_specs, None), **jit_kwargs)
