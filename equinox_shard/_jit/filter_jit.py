"""`filter_jit`: the one call path from a call to `jax.jit` (look up, prepare,
dispatch, combine), its ahead-of-time objects and the public wrapper."""

import functools as ft
import operator
import os
from collections.abc import Callable
from itertools import compress, repeat
from typing import Any, overload, TypeVar
from typing_extensions import ParamSpec

import equinox as eqx
import jax
import jax._src.traceback_util as traceback_util
import jax.tree_util as jtu
import numpy as np
from equinox import field, is_array, Module, module_update_wrapper, Partial

from .._arrays import is_array_or_struct
from .._spec.leaves import unset
from . import explain_misses
from .cache import (
    ArgStructure,
    Cache,
    Call,
    get_cache,
    look_up,
    raise_if_incomparable,
    raise_if_unhashable,
)
from .donation import DonateMode
from .entry import (
    AutoLayouts,
    build_entry,
    diagnose,
    Entry,
    get_committed,
    get_sharding,
    get_weak_type,
    prepare,
)
from .launch import paced_run
from .packing import mirror_combine, mirror_partition


traceback_util.register_exclusion(__file__)


_P = ParamSpec("_P")
_T = TypeVar("_T")


def _call(wrapper, args, kwargs, compiled=None):
    """A call in four steps, each taking the call as one value (`cache.Call`): look up
    its entry (`cache.look_up`; on a miss `_build` makes it), prepare its inputs
    (`entry.prepare`), dispatch (`Entry.dispatch`) and combine the output."""
    __tracebackhide__ = True
    # One attribute lookup, past `Module.__getattribute__` (Python, on every lookup).
    fields = object.__getattribute__(wrapper, "__dict__")
    cache: Cache = fields["_cache"]
    # Read by `eqx.error_if`'s stacks: one per decoration.
    __equinox_jit_id__ = fields["_jit_id"]
    if kwargs or len(args) not in cache.arity:
        args, kwargs = cache.bind(args, kwargs)
    call = _new(Call)
    call.cache, call.fun, call.args = cache, fields["_dynamic_fun"], args
    call.kwargs, call.jit_id = kwargs, __equinox_jit_id__
    call.leaves, treedef = jtu.tree_flatten((args, kwargs))
    leaves = call.leaves
    # 1. Look up.
    if compiled is None:
        key = look_up(call, treedef, is_array)
    else:
        key = compiled._check(call, treedef)
    # 2. Prepare (on a miss, `_build` first makes the entry, under the cache's lock).
    if call.entry is None:
        _build(call, key, fields["_static_fun"])
    else:
        prepare(call)
    if compiled is not None:
        call.run = compiled.compiled
    # 3. Dispatch `run(*dynamic)`: the entry's `jax.jit` (or `Typed`, `AutoLayouts`).
    try:
        if call.entry.dispatch is None:  # no layer: the launch alone
            out = call.run(*call.dynamic)
        else:
            out = call.entry.dispatch(call)
    except eqx.EquinoxRuntimeError:
        raise
    except Exception:
        diagnose(call)
        raise
    if compiled is None:
        # Step 0 is tried for the next call only after a call it would have run (not
        # one whose inputs `prepare` placed): else it costs each call.
        warm = call.entry.warm
        cache.warm = (
            warm
            if warm is not None
            and call.leaves is leaves
            and (call.run is warm.run or call.run is warm.typed)
            else None
        )
    # 4. Combine (`_combine`, inline: one frame less on every call).
    dynamic, static = out
    return dynamic if static is None else static.combine(dynamic)


# A `Call` without a Python frame; `_call` sets its fields.
_new = object.__new__
# `map(_apply, fs, xs)` calls each `f(x)` at C speed.
_apply: Any = operator.call
_NDARRAY = repeat(np.ndarray)


def _combine(out: tuple) -> Any:
    """The output, from its arrays and static part (`packing.OutStatic` or `None`)."""
    dynamic, static = out
    return dynamic if static is None else static.combine(dynamic)


def _build(call: Call, key, static_fun) -> None:
    """A miss (or `.lower()`): finds or makes the structure of `key` and the entry,
    under the cache's lock, and prepares the call."""
    cache = call.cache
    with cache.lock:
        structure = call.structure = cache.structures.get(key)
        if structure is None:
            structure = call.structure = ArgStructure(call, key)
        entry_key = structure.key_in_entries(call.leaves)
        try:
            entry = call.entry = structure.entries.get(entry_key)
        except Exception:
            raise_if_unhashable(call, structure.static_indices)
            raise_if_incomparable(
                call, structure.static_indices, structure.entries.values()
            )
            raise
        if entry is not None:
            # Made meanwhile, or for other leaf types: keep this structure too.
            prepare(call)
        else:
            watch = None
            if jax.config.jax_explain_cache_misses and not jax.config.jax_disable_jit:
                # JAX's own flag: say why, in the caller's names (`explain_misses`).
                watch = explain_misses.miss(call)
            entry = build_entry(call, static_fun, watch)
        if not jax.config.jax_disable_jit:  # under it nothing is traced, nothing kept
            structure.entries[entry_key] = entry
            cache.structures[key] = structure


class Compiled(Module):
    """The result of `filter_jit(f).lower(...).compile()`. Calling it makes the same
    call as `filter_jit(f)`, through the same checks, with this executable."""

    compiled: jax.stages.Compiled
    _wrapper: Any = field(static=True, repr=False)
    _entry: Entry = field(static=True, repr=False)

    def __call__(self, /, *args, **kwargs):
        __tracebackhide__ = True
        return _call(self._wrapper, args, kwargs, self)

    def as_text(self) -> str | None:
        return self.compiled.as_text()

    def _check(self, call: Call, treedef) -> None:
        """Sets its `ArgStructure` and `Entry` on `call`, once checked against them
        (no `StructureKey`: nothing is built)."""
        structure = self._entry.structure
        static = structure.static_of(call.leaves)
        if treedef != structure.treedef or static != self._entry.static:
            raise TypeError(
                "This function was compiled for arguments of structure "
                f"{structure.treedef} with static (non-array) leaves "
                f"{self._entry.static}, but was called with {treedef} and {static}. "
                "Lower and compile it again for these arguments."
            )
        call.structure, call.entry = structure, self._entry

    @property
    def input_shardings(self) -> tuple[tuple, dict]:
        """The shardings of the array arguments, as `(args, kwargs)` in the structure of
        the bound arguments; non-array arguments appear as themselves."""
        return self._inputs(self.compiled.input_shardings)

    @property
    def input_formats(self) -> tuple[tuple, dict]:
        """As `input_shardings`, the formats (layout and sharding); a `Layout.AUTO`
        is the layout the compiler chose, so `eqxs.filter_device_put(args_tree,
        compiled.input_formats[0])` places arguments as this executable wants them."""
        return self._inputs(self.compiled.input_formats)

    def _inputs(self, per_input) -> tuple[tuple, dict]:
        slots, _ = per_input
        structure = self._entry.structure
        leaves: list = [None] * structure.treedef.num_leaves
        for i, x in zip(structure.static_indices, self._entry.static):
            leaves[i] = x
        for i, x in zip(structure.traced_indices, structure.packing.unpack(slots)):
            leaves[i] = x
        return structure.treedef.unflatten(leaves)

    @property
    def output_shardings(self) -> Any:
        """The shardings of the array outputs, in the structure of the output; non-array
        outputs appear as themselves."""
        return _combine(self.compiled.output_shardings)

    @property
    def output_formats(self) -> Any:
        """The formats (layout and sharding) of the array outputs, in the structure of
        the output; non-array outputs appear as themselves."""
        return _combine(self.compiled.output_formats)


class Lowered(Module):
    """The result of `filter_jit(f).lower(...)`."""

    lowered: jax.stages.Lowered
    _wrapper: Any = field(static=True, repr=False)
    _entry: Entry = field(static=True, repr=False)

    def as_text(self) -> str:
        return self.lowered.as_text()

    def compile(
        self, /, compiler_options: dict[str, str | bool] | None = None
    ) -> Compiled:
        compiled = self.lowered.compile(compiler_options=compiler_options)
        if isinstance(self._entry.jitted, AutoLayouts):
            # `jax.jit` refuses arrays for `Layout.AUTO`: calls run this executable.
            with self._wrapper._cache.lock:
                self._entry.jitted.compiled = compiled
        return Compiled(compiled, self._wrapper, self._entry)


class _JitWrapper(Module):
    fn: str  # this attribute exists solely to give a nice repr
    _dynamic_fun: Any = field(repr=False)
    _static_fun: Any = field(static=True, repr=False)
    _cache: Cache = field(static=True, repr=False)
    _jit_id: bytes = field(static=True, repr=False)

    @property
    def __wrapped__(self):
        return mirror_combine(self._dynamic_fun, self._static_fun)

    def __call__(self, /, *args, **kwargs):
        __tracebackhide__ = True
        fields = object.__getattribute__(self, "__dict__")
        cache: Cache = fields["_cache"]
        # Read by `eqx.error_if`'s stacks: one per decoration.
        __equinox_jit_id__ = fields["_jit_id"]
        try:
            warm = cache.warm
            if warm is None:
                return _call(self, args, kwargs)
            # 0. The last warm call's entry, without a look-up or `prepare`, if this
            # call has its structure (bound, as its equal treedef says), static part
            # and leaf types (`entry._warm`).
            leaves, treedef = jtu.tree_flatten((args, kwargs))
            traced_of, static_of, types, hashed = warm[1:5]
            is_deleted, run, entry, typed, placed, packs, serialized = warm[5:]
            try:
                traced = traced_of(leaves)
                if is_deleted is None:  # NumPy: `jax.jit` moves it, so `Typed` runs it
                    taken = all(map(operator.is_, map(type, traced), _NDARRAY))
                    if placed is not None:
                        run = typed
                else:  # `is_deleted` (of one `jax.Array` type) refuses any other type
                    taken = not any(map(is_deleted, traced))
                    committed = placed and list(map(get_committed, traced))
                    # Uncommitted inputs' shardings unread: `.sharding` makes one.
                    if committed and not (
                        (some := any(committed))
                        and all(map(operator.eq, map(get_sharding, traced), placed))
                    ):
                        # Not all on their targets (`all_placed`): `Typed` runs it
                        # where `jax.jit` moves the uncommitted ones (`MOVES`).
                        taken = (
                            taken
                            and not any(map(get_weak_type, traced))
                            and (
                                not some
                                or all(
                                    map(
                                        operator.eq,
                                        map(get_sharding, compress(traced, committed)),
                                        compress(placed, committed),
                                    )
                                )
                            )
                        )
                        run = typed
                taken = (
                    taken
                    and run is not None
                    and treedef == warm.treedef
                    and (
                        not types
                        or tuple(map(type, static := static_of(leaves))) == types
                        and hash(static) == hashed
                        and static == entry.static
                    )
                )
            except Exception:  # another leaf type or structure, an odd `__eq__`
                taken = False
            if not taken:
                # (Flattened again there: one pass, only when step 0 was tried.)
                return _call(self, args, kwargs)
            fun = fields["_dynamic_fun"]
            if packs is None:
                dynamic = (*args[:1], fun, *args[1:], kwargs)
            else:  # `Packing.arguments`, inline
                packed = map(_apply, packs[0], repeat(leaves))
                *parts, packed_kwargs = map(_apply, packs[1], packed)
                dynamic = (*parts[:1], fun, *parts[1:], packed_kwargs)
            try:
                # `Typed`'s executable, past `Typed.__call__`'s frame where it runs.
                compiled = None
                if run is typed and not serialized and not jax.config.jax_disable_jit:
                    compiled = typed.compiled
                try:
                    runs = run if compiled is None else compiled
                    if serialized:  # several CPU devices: as `launch.paced_serialized`
                        dynamic, static = paced_run(
                            runs,  # pyright: ignore[reportArgumentType]
                            dynamic,
                            traced,  # pyright: ignore[reportPossiblyUnboundVariable]
                            is_deleted,
                        )
                    else:
                        dynamic, static = runs(*dynamic)  # pyright: ignore[reportOptionalCall]
                except (TypeError, ValueError):
                    if compiled is None:
                        raise
                    # Refused before it runs (other shapes): `Typed` says what runs.
                    dynamic, static = typed(*dynamic)
                except Exception:
                    if compiled is None:
                        raise
                    # It ran and raised (`jax.debug_nans`'s error): `Typed` says why.
                    dynamic, static = typed.rerun(dynamic)
            except eqx.EquinoxRuntimeError:
                raise
            except Exception:
                call = _new(Call)
                call.cache, call.fun, call.args, call.kwargs = cache, fun, args, kwargs
                call.jit_id, call.leaves = __equinox_jit_id__, leaves
                call.structure, call.entry = entry.structure, entry
                diagnose(call)
                raise
            return dynamic if static is None else static.combine(dynamic)
        except eqx.EquinoxRuntimeError as e:
            e.__traceback__ = None
            raise

    def _ahead(self, args, kwargs, stage: Callable) -> tuple[Entry, Any]:
        """`stage(entry, dynamic)` for `.lower` and `.eval_shape`, whose arguments are
        checked, and errors named, as a call's."""
        call = _new(Call)
        call.cache, call.fun, call.jit_id = self._cache, self._dynamic_fun, self._jit_id
        call.args, call.kwargs = self._cache.bind(args, kwargs)
        call.leaves, treedef = jtu.tree_flatten((call.args, call.kwargs))
        key = look_up(call, treedef, is_array_or_struct)
        _build(call, key, self._static_fun)
        try:
            return call.entry, stage(call.entry, call.dynamic)
        except Exception:
            # The entry was checked for the shapes of the call that made it.
            diagnose(call)
            raise

    def lower(self, /, *args, **kwargs) -> Lowered:
        """Lowers the function for the given arguments, ahead of time. Arrays may be
        replaced by `jax.ShapeDtypeStruct`s (optionally carrying a `sharding`)."""

        def lower(entry, dynamic):
            # Lowered for the types the entry was traced for (`Typed`): one trace.
            if entry.typed is not None:
                dynamic, _ = entry.typed.types(dynamic)
            # With host callbacks, the guarded program is what calls run.
            jitted = entry.jitted if entry.guards is None else entry.guards.jitted
            with self._cache.donation.tracing():
                return jitted.lower(*dynamic)

        entry, lowered = self._ahead(args, kwargs, lower)
        return Lowered(lowered, self, entry)

    def eval_shape(self, /, *args, **kwargs) -> Any:
        """The output as `jax.ShapeDtypeStruct`s with shardings, `out_shardings` on
        `Auto` axes too, without running; arguments as for `.lower`. Under
        `jax.set_mesh(mesh)`, shardings are on `mesh` itself (not its abstract mesh),
        ready for `equinox_shard.restore` or `equinox_shard.sharding_table`."""

        def trace(entry, dynamic):
            # Traced for the types a call gives (`Typed`: on Explicit axes, each
            # input at its `in_shardings` type), as `.lower` is.
            if entry.typed is not None:
                dynamic, _ = entry.typed.types(dynamic)
            return entry.jitted.trace(*dynamic)

        return _combine(self._ahead(args, kwargs, trace)[1].out_info)

    def __get__(self, instance, owner):
        del owner
        if instance is None:
            return self
        return Partial(self, instance)


@overload
def filter_jit(
    *,
    in_shardings: Any = unset,
    out_shardings: Any = unset,
    donate: DonateMode = "none",
) -> Callable[[Callable[_P, _T]], Callable[_P, _T]]: ...


@overload
def filter_jit(
    fun: Callable[_P, _T],
    *,
    in_shardings: Any = unset,
    out_shardings: Any = unset,
    donate: DonateMode = "none",
) -> Callable[_P, _T]: ...


def filter_jit(
    fun=unset,
    *,
    in_shardings: Any = unset,
    out_shardings: Any = unset,
    donate: DonateMode = "none",
):
    """An easier-to-use version of `jax.jit` that also takes shardings. All JAX and
    NumPy arrays are traced and all other types are held static, exactly as in
    `equinox.filter_jit`.

    **Arguments:**

    - `fun`: a pure function to JIT compile.
    - `in_shardings`: where the array arguments live: a single specification for every
        array argument, or a tuple (or list, as for `jax.jit`) with one PyTree prefix
        per positional parameter of `fun` (after binding the call to its signature);
        with `*args`, one per positional argument of the call, as for `jax.jit`; or a
        dict by parameter name (`{"x": P("data")}`), every parameter it does not name
        unspecified.
        Spec leaves are those of [`equinox_shard.filter_device_put`][]: a
        `jax.sharding.Sharding`, a `jax.Device`, a bare `jax.sharding.PartitionSpec`, a
        `jax.experimental.layout.Format` (whose `Layout.AUTO` leaves the layout to
        the compiler), a callable `leaf -> spec` or an
        [`equinox_shard.PathRules`][]; `None`, and any argument not covered, is
        unspecified. A `jax.memory.Space` is refused here (`jax.jit` takes none for
        an input): give a sharding with a memory kind. Uncommitted and NumPy arrays
        go to `jax.jit` as they are, which moves them (on Explicit axes the function
        sees every input at its `in_shardings` type); a committed array on another
        sharding (which `jax.jit` refuses) is moved first, as a copy that leaves the
        caller's array alive unless donated (then freed exactly where `jax.jit` would
        free it; see docs/semantics.md).
    - `out_shardings`: a PyTree prefix of the output, in the same language, given to
        `jax.jit`'s own `out_shardings`; a `jax.memory.Space` is taken here too, and
        applied inside the function. Non-array outputs are returned untouched.
    - `donate`: as in `equinox.filter_jit`: `'all'`, `'all-except-first'`, `'warn'`,
        `'warn-except-first'` or `'none'` (the default). An array also passed where
        it is not donated is kept (a private copy is donated), so no kept array is
        ever deleted; one array donated twice (tied weights, `f(x, x)`), or an array
        of the function being JIT'd (a bound method's Module), whose arrays are
        donated, passed again as an argument, is a `ValueError`.

    **Returns:**

    The JIT'd version of `fun`, with `.lower(*args, **kwargs)` (arrays may be
    `jax.ShapeDtypeStruct`s) and `.eval_shape(*args, **kwargs)`.

    Errors are raised before anything runs, naming the array by its key path in the
    caller's argument names (e.g. `model.layers[0].weight`).

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
    if fun is unset:
        return ft.partial(
            filter_jit,
            in_shardings=in_shardings,
            out_shardings=out_shardings,
            donate=donate,
        )
    dynamic_fun, static_fun = mirror_partition(fun)
    cache = get_cache(fun, static_fun, donate, in_shardings, out_shardings)
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
