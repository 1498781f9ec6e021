"""Donation (RFC §6): what one decoration's `Donation` donates, the private copies that
keep every array the caller keeps, and how a donating call launches."""

import collections as co
import contextlib
import functools as ft
import warnings
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax._src.traceback_util as traceback_util
import jax.tree_util as jtu

from .._arrays import is_deleted, is_tracer, raise_if_fun_deleted
from .._buffers import private_copies, reuses_every_buffer
from .launch import dispatch_lock


traceback_util.register_exclusion(__file__)


#
# Which inputs a mode donates.
#


DonateMode = Literal["all", "all-except-first", "warn", "warn-except-first", "none"]


# mode -> (whether the argument at `position` (`None`: keyword arguments and the
# function's arrays) is donated; whether JAX's unusable-donation warning is ignored).
MODES: dict[str, tuple[Callable[[int | None, int], bool], bool]] = {
    "all": (lambda position, n_args: True, True),
    "all-except-first": (lambda position, n_args: position != 0, True),
    "warn": (lambda position, n_args: True, False),
    "warn-except-first": (lambda position, n_args: position != 0, False),
    "none": (lambda position, n_args: False, False),
}


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

    def argnums(self, n_args: int) -> tuple[int, ...]:
        """`jax.jit`'s `donate_argnums` for the traced function `(fun, kwargs, *args)`
        of a call with `n_args` positional arguments."""
        rest = self._donates(None, n_args)
        donated = (rest, rest, *(self._donates(p, n_args) for p in range(n_args)))
        return tuple(i for i, d in enumerate(donated) if d)

    def leaves(self, args: tuple, traced_indices: tuple[int, ...]) -> tuple[int, ...]:
        """The donated leaves of the bound `(args, kwargs)`, by index: the traced
        leaves (`traced_indices`) in a donated argument."""
        n_args = len(args)
        flags = []
        for p, arg in enumerate(args):
            flags += [self._donates(p, n_args)] * len(jtu.tree_leaves(arg))
        rest = self._donates(None, n_args)  # the keyword arguments' leaves
        return tuple(
            i for i in traced_indices if (flags[i] if i < len(flags) else rest)
        )

    def donates(self, leaves: tuple[int, ...], dynamic_fun: Any, n_args: int) -> bool:
        """Whether an entry donates anything: its donated `leaves` (`Donation.leaves`)
        or the function's own arrays (`dynamic_fun`, `None` where it has none)."""
        return bool(leaves) or (dynamic_fun is not None and self._donates(None, n_args))

    #
    # What a donating call does: the work of each call, made per entry.
    #

    def keeper(
        self,
        leaves: tuple[int, ...],
        traced_indices: tuple[int, ...],
        n_args: int,
        fun_name: str,
    ) -> Callable:
        """`keep(call_leaves, dynamic_fun, where)`, run before each call of an entry
        that donates: see `keep_undonated`."""
        fun_donated = self._donates(None, n_args)
        return ft.partial(keep_undonated, leaves, traced_indices, fun_donated, fun_name)

    def may_alias(self, leaves: list, moves: list, donated: tuple[int, ...]) -> list:
        """`place`'s `may_alias`, per leaf, for the moves `(i, sharding)` of a call's
        inputs before `jax.jit`: a moved array is never returned to the caller, so it
        may share the caller's buffers, except that a donated one shares all of them
        (donating it then frees the caller's array, where `jax.jit` frees a donated
        input that it moves) or none (`reuses_every_buffer`)."""
        donated_set = frozenset(donated)
        may_alias = [True] * len(leaves)
        for i, sharding in moves:
            if i in donated_set:
                may_alias[i] = reuses_every_buffer(leaves[i], sharding)
        return may_alias

    def launch(self, dynamic_fun: Any) -> Callable:
        """The launch of an entry that donates (see `launch.stack`): under
        `launch.dispatch_lock`, its inputs (and `dynamic_fun`'s arrays) checked again,
        and JAX's warning of unusable donations ignored where the mode says so."""
        return _donating(self._quiet, bool(jtu.tree_leaves(dynamic_fun)))

    def tracing(self) -> contextlib.AbstractContextManager:
        """The context to trace or lower in: JAX's warning of unusable donations is
        expected there, whatever the mode."""
        return _unusable_donations_ignored()


#
# Nothing kept is donated.
#


def keep_undonated(
    donated: tuple[int, ...],
    traced_indices: tuple[int, ...],
    fun_donated: bool,
    fun_name: str,
    leaves: list,
    dynamic_fun: Any,
    where: Callable[[int], str],
) -> list:
    """`leaves` with every `donated` array reachable twice in the call replaced by a
    private copy: donating one occurrence would free the others (XLA crashes)."""
    fun_leaves = jtu.tree_leaves(dynamic_fun) if fun_donated else []
    if any(map(is_deleted, fun_leaves)):
        raise_if_fun_deleted(fun_name, dynamic_fun)
    traced_ids = {id(leaves[i]) for i in traced_indices}
    fun_ids = {id(x) for x in fun_leaves}
    if len(traced_ids) == len(traced_indices) and traced_ids.isdisjoint(fun_ids):
        return leaves  # the common case, checked at C speed
    for i in traced_indices:
        if id(leaves[i]) in fun_ids:
            raise ValueError(
                f"{where(i)}: this array is also part of the function being JIT'd, "
                "whose arrays are donated; an array cannot be both donated and passed "
                "again."
            )
    counts = co.Counter(id(leaves[i]) for i in traced_indices)
    # NumPy inputs are copied onto the device by every call anyway.
    copies = [
        i
        for i in donated
        if counts[id(leaves[i])] > 1 and isinstance(leaves[i], jax.Array)
    ]
    if copies:
        leaves = list(leaves)
        tracers = [i for i in copies if is_tracer(leaves[i])]
        for i in tracers:  # under `grad` or `vmap` the primal values are donated
            leaves[i] = jax.numpy.array(leaves[i], copy=True)
        private_copies(leaves, [i for i in copies if i not in tracers])
    return leaves


#
# The launch of a donating call (see `launch`), and JAX's warning.
#


def _donating(quiet: bool, fun_arrays: bool) -> Callable:
    """`Donation.launch`; `fun_arrays`: whether the function holds arrays."""

    def dispatch(run, dynamic, deleted, leaves, jit_id):
        with dispatch_lock:
            # Again under the lock: another thread may have donated an input since.
            if deleted(leaves) or (
                fun_arrays and any(map(is_deleted, jtu.tree_leaves(dynamic[0])))
            ):
                raise RuntimeError("An input was donated by another thread.")
            if not quiet:
                return run(*dynamic)
            with _unusable_donations_ignored():
                return run(*dynamic)

    return dispatch


@contextlib.contextmanager
def _unusable_donations_ignored():
    """JAX's warning of donated buffers no output reuses: expected under `'all'`."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="Some donated buffers were not usable"
        )
        yield
