"""Donation: which arguments a `filter_jit` donates, private copies so that no array
the caller keeps is donated, and the launch of a donating call (RFC §6). Whether an
array is deleted, and the one message for it, are `_arrays`'."""

import collections as co
import contextlib
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax._src.traceback_util as traceback_util
import jax.tree_util as jtu
from jax.sharding import Sharding

from ._arrays import is_concrete, is_deleted, is_tracer, raise_if_fun_deleted
from ._launch import dispatch_lock


traceback_util.register_exclusion(__file__)


# mode -> (donate_first, donate_rest, filter_warning)
DONATE_MODES = {
    "all": (True, True, True),
    "all-except-first": (False, True, True),
    "warn": (True, True, False),
    "warn-except-first": (False, True, False),
    "none": (False, False, False),
}


def donate_argnums(donate_first: bool, donate_rest: bool, n_args: int) -> tuple:
    """`jax.jit`'s `donate_argnums` for the traced function `(fun, kwargs, *args)`."""
    donate = [0, 1] if donate_rest else []
    if n_args and donate_first:
        donate.append(2)
    if donate_rest:
        donate.extend(range(3, 2 + n_args))
    return tuple(donate)


#
# Nothing kept is donated.
#


def private_copies(leaves: list, indices: list[int]) -> None:
    """Replaces each `leaves[i]`, `i` in `indices`, by a copy with the same sharding
    that shares no buffer with it."""
    if not indices:
        return
    copies = jax.device_put(
        [leaves[i] for i in indices],
        [leaves[i].sharding for i in indices],
        may_alias=False,
    )
    for i, x in zip(indices, copies):
        leaves[i] = x


def shares_source_buffer(leaf: Any, sharding: Sharding) -> bool:
    """Whether `jax.device_put(leaf, sharding, may_alias=False)` may still hand back one
    of `leaf`'s own buffers as a shard of the result: JAX reuses a buffer wherever the
    result's shard on a device is exactly `leaf`'s shard on that device, whatever
    `may_alias` says (upstream/jax-reports/device-put-may-alias-replicated)."""
    if not isinstance(leaf, jax.Array):
        return False
    source = leaf.sharding
    if source.device_set.isdisjoint(sharding.device_set):
        return False
    if len(source.device_set) == 1:
        # Onto its own device alone, JAX does copy.
        return len(sharding.device_set) > 1 and sharding.is_fully_replicated
    source_map = source.devices_indices_map(leaf.shape)
    return any(
        source_map.get(device) == index
        for device, index in sharding.devices_indices_map(leaf.shape).items()
    )


def reuses_every_buffer(leaf: Any, sharding: Sharding) -> bool:
    """Whether `jax.device_put(leaf, sharding)` hands back every one of `leaf`'s buffers
    as a shard of its result (onto its own device, or replicated over devices that
    include all of `leaf`'s), so that donating the result deletes `leaf`, as `jax.jit`
    does with a donated input that it moves."""
    if not is_concrete(leaf):
        return False
    target_map = sharding.devices_indices_map(leaf.shape)
    return all(
        target_map.get(device) == index
        for device, index in leaf.sharding.devices_indices_map(leaf.shape).items()
    )


def keep_undonated(
    leaves: list,
    donated: tuple,
    dynamic: tuple,
    dynamic_fun: Any,
    where: Callable[[int], str],
    fun_name: str,
) -> list:
    """Before a donating call: `leaves` with every donated array that is reachable
    twice in the call (donated twice, or donated and kept: donating one occurrence
    would free the others within the same execution, which crashes XLA for multi-device
    arrays) replaced by a private copy. `dynamic_fun` holds the function's arrays when
    they are donated too: one of them passed again as an argument raises."""
    fun_leaves = jtu.tree_leaves(dynamic_fun)
    if any(map(is_deleted, fun_leaves)):
        raise_if_fun_deleted(fun_name, dynamic_fun)
    dynamic_ids = {id(leaves[i]) for i in dynamic}
    fun_ids = {id(x) for x in fun_leaves}
    if len(dynamic_ids) == len(dynamic) and dynamic_ids.isdisjoint(fun_ids):
        return leaves  # the common case, checked at C speed
    for i in dynamic:
        if id(leaves[i]) in fun_ids:
            raise ValueError(
                f"{where(i)}: this array is also part of the function being JIT'd, "
                "whose arrays are donated; an array cannot be both donated and passed "
                "again."
            )
    counts = co.Counter(id(leaves[i]) for i in dynamic)
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
# The launch of a donating call (see `_launch`).
#


def donating(filter_warning: bool, fun_arrays: bool) -> Callable:
    """The launch of an entry that donates (see `_launch.stack`): under
    `_launch.dispatch_lock`, its inputs checked again, and JAX's warning of unusable
    donations filtered where `filter_warning`. `fun_arrays`: whether the function
    itself holds arrays (`dynamic[0]`)."""

    def dispatch(run, dynamic, deleted, leaves, jit_id):
        with dispatch_lock:
            # Again under the lock: another thread may have donated an input since.
            if deleted(leaves) or (
                fun_arrays and any(map(is_deleted, jtu.tree_leaves(dynamic[0])))
            ):
                raise RuntimeError("An input was donated by another thread.")
            if not filter_warning:
                return run(*dynamic)
            with unusable_donations_ignored():
                return run(*dynamic)

    return dispatch


@contextlib.contextmanager
def unusable_donations_ignored():
    """JAX warns of each donated buffer that no output can reuse: with `donate='all'`
    (not `'warn'`) and while tracing, that is expected."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="Some donated buffers were not usable"
        )
        yield
