"""Donation (RFC §6): what one decoration's `Donation` donates, the private copies that
keep every array the caller keeps, and how a donating call launches."""

import collections as co
import contextlib
import functools as ft
import warnings
from collections.abc import Callable
from itertools import chain, repeat
from typing import Any, Literal, NamedTuple

import jax
import jax._src.traceback_util as traceback_util
import jax.tree_util as jtu

from .._arrays import (
    identity_hash,
    is_deleted,
    is_tracer,
    raise_if_deleted,
    raise_if_fun_deleted,
)
from .._buffers import jit_frees, private_copies
from .._dispatch import dispatch_lock
from .packing import getter


traceback_util.register_exclusion(__file__)


DonateMode = Literal["all", "all-except-first", "warn", "warn-except-first", "none"]


# mode -> (whether the argument at `position` is donated (`None`: the keyword arguments
# and the function's arrays), whether JAX's unusable-donation warning is ignored).
MODES: dict[str, tuple[Callable[[int | None, int], bool], bool]] = {
    "all": (lambda position, n_args: True, True),
    "all-except-first": (lambda position, n_args: position != 0, True),
    "warn": (lambda position, n_args: True, False),
    "warn-except-first": (lambda position, n_args: position != 0, False),
    "none": (lambda position, n_args: False, False),
}


@contextlib.contextmanager
def _unusable_donations_ignored():
    """Ignores JAX's warning of donated buffers that no output reuses."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="Some donated buffers were not usable"
        )
        yield


class Donation:
    """What one `filter_jit(donate=mode)` decoration donates; asked when an entry is
    built, never on a call."""

    __slots__ = ("_donates", "_quiet")

    def __init__(self, mode: Any):
        try:
            self._donates, self._quiet = MODES[mode]
        except (KeyError, TypeError):
            *names, last = map(repr, MODES)
            raise ValueError(
                f"`filter_jit(..., donate=...)` must be one of {', '.join(names)}, "
                f"or {last}; got {mode!r}."
            ) from None

    def slot_starts(self, named: int, n_args: int) -> tuple[int, ...]:
        """Where `Packing` begins a slot of the variadic arguments (those from `named`
        on) of a call with `n_args` positional arguments: at the first, at each one
        donated unlike the one before (`jax.jit` donates whole slots), and where any
        input is donated at the second, which follows the function (Equinox's order)."""
        flags = [self._donates(p, n_args) for p in range(n_args)]
        ordered = any(flags) or self._donates(None, n_args)
        return tuple(
            p
            for p in range(named, n_args)
            if p == named or flags[p] != flags[p - 1] or (p == 1 and ordered)
        )

    def argnums(self, positions: tuple, n_args: int) -> tuple[int, ...]:
        """`jax.jit`'s `donate_argnums` for slots holding `positions`
        (`Packing.positions`) of a call with `n_args` positional arguments."""
        return tuple(i for i, p in enumerate(positions) if self._donates(p, n_args))

    def leaves(self, args: tuple, traced_indices: tuple[int, ...]) -> tuple[int, ...]:
        """The indices of the traced leaves of `(args, kwargs)` in donated arguments."""
        n_args = len(args)
        flags = []
        for p, arg in enumerate(args):
            flags += [self._donates(p, n_args)] * len(jtu.tree_leaves(arg))
        rest = self._donates(None, n_args)  # the keyword arguments' leaves
        return tuple(
            i for i in traced_indices if (flags[i] if i < len(flags) else rest)
        )

    def donates(self, leaves: tuple[int, ...], dynamic_fun: Any, n_args: int) -> bool:
        """Whether an entry donates its `leaves` or the arrays of `dynamic_fun` (`None`
        where it has none)."""
        return bool(leaves) or (dynamic_fun is not None and self._donates(None, n_args))

    def keeper(self, call: Any, targets: list[tuple[int, Any]]) -> Callable:
        """A donating entry's `keep(call)`: `keep_undonated`, for the entry of `call`
        that places leaf `i` on `sharding` for each `(i, sharding)` of `targets`."""
        structure, n_args = call.structure, len(call.args)
        leaves, traced_indices = structure.donated, structure.traced_indices
        placed = dict(targets)
        onto = tuple(i for i in leaves if _in_unpinned_host(placed.get(i)))
        passed = getter(tuple(i for i in leaves if i not in placed))
        known = _Kept(
            leaves,
            (traced_indices, getter(traced_indices)),
            self._donates(None, n_args),
            call.cache.fun_name,
            (onto, passed),
        )
        return ft.partial(keep_undonated, known)

    def may_alias(self, leaves: list, moves: list, donated: tuple[int, ...]) -> list:
        """`place`'s `may_alias` per leaf, for `moves` `(i, sharding)`: a moved array
        never reaches the caller, so it may share the caller's buffers, but a donated
        one shares them only where `jax.jit` frees a donated input that it moves
        (`jit_frees`), since donating the moved array frees the caller's."""
        donated_set = frozenset(donated)
        may_alias = [True] * len(leaves)
        for i, sharding in moves:
            if i in donated_set:
                may_alias[i] = jit_frees(leaves[i], sharding)
        return may_alias

    def launch(self, dynamic_fun: Any, fun_at: int | None) -> Callable:
        """A donating entry's launch (`launch.stack`): under `dispatch_lock`, its
        inputs and `dynamic_fun`'s arrays (slot `fun_at`) checked again, and JAX's
        unusable-donation warning ignored where the mode says so."""
        quiet = self._quiet
        if not jtu.tree_leaves(dynamic_fun):
            fun_at = None

        def dispatch(call):
            dynamic = call.dynamic
            with dispatch_lock:
                # Again under the lock: another thread may have donated an input since.
                if call.structure.deleted(call.leaves) or (
                    fun_at is not None
                    and any(map(is_deleted, jtu.tree_leaves(dynamic[fun_at])))
                ):
                    raise RuntimeError("An input was donated by another thread.")
                if not quiet:
                    return call.run(*dynamic)
                with _unusable_donations_ignored():
                    return call.run(*dynamic)

        return dispatch

    # To trace or lower in: JAX's unusable-donation warning is expected in any mode.
    tracing = staticmethod(_unusable_donations_ignored)


class _Kept(NamedTuple):
    """What `keep_undonated` knows of an entry."""

    donated: tuple[int, ...]
    traced: tuple[tuple[int, ...], Callable]  # the indices, and their C-level getter
    fun_donated: bool
    fun_name: str
    # The donated leaves that `targets` place in `unpinned_host` memory, and the getter
    # of those passed to `jax.jit` as they are.
    unpinned: tuple[tuple[int, ...], Callable]


def keep_undonated(known: _Kept, call: Any) -> list:
    """`call.leaves` with each donated array also passed where it is not donated
    replaced by a private copy (donating it would free the other); one donated twice
    raises, as does one in `unpinned_host` memory."""
    donated, traced, fun_donated, fun_name, unpinned = known
    leaves, dynamic_fun, where = call.leaves, call.fun, call.where
    fun_leaves = jtu.tree_leaves(dynamic_fun) if fun_donated else []
    if any(map(is_deleted, fun_leaves)):
        raise_if_fun_deleted(fun_name, dynamic_fun)
    onto, passed = unpinned
    if onto or _UNPINNED in _memory_kinds(chain(passed(leaves), fun_leaves)):
        _raise_if_unpinned(leaves, onto, passed, where)
        paths = jtu.tree_flatten_with_path(dynamic_fun)[0]
        fun_where = lambda k: fun_name + jtu.keystr(paths[k][0])
        _raise_if_unpinned(fun_leaves, (), lambda a: a, fun_where)
    traced_indices, get_traced = traced
    traced_ids = set(map(identity_hash, get_traced(leaves)))
    fun_ids = set(map(identity_hash, fun_leaves))
    if (
        len(traced_ids) == len(traced_indices)
        and traced_ids.isdisjoint(fun_ids)
        and len(fun_ids) == len(fun_leaves)
    ):
        return leaves  # the common case, checked at C speed
    fun_ids = {id(x) for x in fun_leaves}
    if len(fun_ids) < len(fun_leaves):
        paths = jtu.tree_flatten_with_path(dynamic_fun)[0]
        fun_where = lambda k: fun_name + jtu.keystr(paths[k][0])
        buffers = [k for k, x in enumerate(fun_leaves) if _is_buffer(x)]
        _raise_if_donated_twice(fun_leaves, buffers, fun_where)
    for i in traced_indices:
        if id(leaves[i]) in fun_ids:
            raise ValueError(
                f"{where(i)}: this array is also part of the function being JIT'd, "
                "whose arrays are donated; an array cannot be both donated and passed "
                "again."
            )
    counts = co.Counter(id(leaves[i]) for i in traced_indices)
    shared = [i for i in donated if counts[id(leaves[i])] > 1]
    kept = [i for i in shared if _is_buffer(leaves[i])]
    tracers = [i for i in shared if is_tracer(leaves[i])]
    _raise_if_donated_twice(leaves, kept, where)
    raise_if_deleted(leaves, traced_indices, where)  # before a copy is tried
    if kept or tracers:
        leaves = list(leaves)
        for i in tracers:  # under `grad` or `vmap` the primal values are donated
            leaves[i] = jax.numpy.array(leaves[i], copy=True)
        # An uncommitted copy stays uncommitted, as `jax.jit` may move it with the rest.
        uncommitted = [i for i in kept if not leaves[i].committed]
        for i in uncommitted:
            leaves[i] = jax.device_put(leaves[i], may_alias=False)
        private_copies(leaves, [i for i in kept if i not in uncommitted])
    return leaves


def _is_buffer(x: Any) -> bool:
    # NumPy arrays are copied by every call; tracers are not the caller's buffers.
    return isinstance(x, jax.Array) and not is_tracer(x)


def _raise_if_donated_twice(leaves: list, indices, where: Callable[[int], str]) -> None:
    """Raises, naming both, if two of `indices` hold the same array."""
    first: dict[int, int] = {}
    for i in indices:
        j = first.setdefault(id(leaves[i]), i)
        if j != i:
            raise ValueError(
                f"{where(j)} and {where(i)} are the same array, and both are donated; "
                "an array can be donated once per call (`jax.jit` refuses a committed "
                "one). Pass it once (tie weights with `eqx.nn.Shared`), or where it is "
                "not donated."
            )


# XLA aborts the process on a donated buffer in this memory (JAX 0.10.2, 0.12.1, CPU).
_UNPINNED = "unpinned_host"


def _in_unpinned_host(sharding: Any) -> bool:
    return getattr(sharding, "memory_kind", None) == _UNPINNED


def _memory_kinds(values) -> Any:
    """Each of `values`' memory kind (`None` for NumPy and tracers), at C speed."""
    shardings = map(getattr, values, repeat("sharding"), repeat(None))
    return map(getattr, shardings, repeat("memory_kind"), repeat(None))


def _raise_if_unpinned(
    leaves: list, onto: tuple[int, ...], passed: Callable, where: Callable[[int], str]
) -> None:
    """Raises, naming it, for the first donated leaf in `unpinned_host` memory: placed
    there (`onto`), or among `passed(range(len(leaves)))` as it is."""
    hint = (
        "which XLA cannot donate (it aborts the process). Pass it where it is not "
        "donated, or in device memory"
    )
    for i in onto:
        raise ValueError(
            f"{where(i)}: this array is donated, but `in_shardings` places it in "
            f"`unpinned_host` memory, {hint} (an `in_shardings` sharding without "
            "`memory_kind`, or with `memory_kind='pinned_host'`)."
        )
    for i in passed(range(len(leaves))):
        if _in_unpinned_host(getattr(leaves[i], "sharding", None)):
            raise ValueError(
                f"{where(i)}: this array is donated, but it is in `unpinned_host` "
                f"memory, {hint} (`filter_device_put(x, "
                "x.sharding.with_memory_kind('device'))`)."
            )
