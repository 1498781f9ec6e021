"""Donation, and the arrays it deletes: which arguments a `filter_jit` donates, the one
test and the one message for a deleted array, private copies so that no array the
caller keeps is donated, and the dispatch of a donating call (RFC §6)."""

import collections as co
import contextlib
import threading
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax._src.traceback_util as traceback_util
import jax.core
import jax.tree_util as jtu
from jax.sharding import Sharding

from ._mirror import getter
from ._spec import is_abstract


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


def is_key_array(x: Any) -> bool:
    """Whether `x` (an array or a `jax.ShapeDtypeStruct`) holds typed PRNG keys."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.numpy.issubdtype(dtype, jax.dtypes.prng_key)


def is_deleted(x: Any) -> bool:
    """Whether `x` is a concrete `jax.Array` whose buffers are gone (e.g. donated)."""
    return (
        isinstance(x, jax.Array)
        and not isinstance(x, jax.core.Tracer)
        and x.is_deleted()  # pyright: ignore[reportAttributeAccessIssue]
    )


def raise_if_deleted(
    leaves,
    indices,
    where: Callable[[int], str],
    what: str = "this array",
    then: str = "",
    error: type[Exception] = RuntimeError,
) -> None:
    """Raises `error` naming `where(i)`, the key path, for the first deleted
    `leaves[i]`, `i` in `indices`."""
    for i in indices:
        if is_deleted(leaves[i]):
            raise error(
                f"{where(i)}: {what} has been deleted (was it donated to an earlier "
                f"call?){then}."
            )


def raise_if_fun_deleted(fun_name: str, dynamic_fun: Any) -> None:
    """As `raise_if_deleted`, for the arrays of the function being JIT'd."""
    flat = jtu.tree_flatten_with_path(dynamic_fun)[0]
    where = lambda i: fun_name + jtu.keystr(flat[i][0])
    what = "this array of the function being JIT'd"
    raise_if_deleted([x for _, x in flat], range(len(flat)), where, what)


def deleted_test(leaves: list, indices: tuple) -> Callable[[list], bool]:
    """A fast `leaves -> bool`: whether any `leaves[i]`, `i` in `indices`, is deleted.
    For leaves of one array type, that type's own `is_deleted`, mapped at C speed."""
    get = getter(indices)

    def slow(leaves):
        return any(map(is_deleted, get(leaves)))

    kinds = {type(leaves[i]) for i in indices}
    (kind,) = kinds if len(kinds) == 1 else (None,)
    if not (
        kind is not None
        and issubclass(kind, jax.Array)
        and not issubclass(kind, jax.core.Tracer)
    ):
        return slow
    kind_is_deleted = kind.is_deleted

    def fast(leaves):
        try:
            return any(map(kind_is_deleted, get(leaves)))
        except (TypeError, AttributeError):  # a `Compiled` called with other types
            return slow(leaves)

    return fast


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
    if not isinstance(leaf, jax.Array) or isinstance(leaf, jax.core.Tracer):
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
        tracers = [i for i in copies if isinstance(leaves[i], jax.core.Tracer)]
        for i in tracers:  # under `grad` or `vmap` the primal values are donated
            leaves[i] = jax.numpy.array(leaves[i], copy=True)
        private_copies(leaves, [i for i in copies if i not in tracers])
    return leaves


#
# Dispatch: `dispatch(run, dynamic, deleted, leaves, jit_id)`, one per entry.
#

# Serialises the launch (not the execution) of multi-device executables on the CPU
# (upstream/jax-reports/cpu-multidevice-dispatch-threads) and of donating calls
# (upstream/jax-reports/donate-from-threads). Re-entrant: under `jax.disable_jit` the
# dispatch runs the function, which may call another `filter_jit`.
dispatch_lock = threading.RLock()


def plain(run, dynamic, deleted, leaves, jit_id):
    return run(*dynamic)


def serialized(run, dynamic, deleted, leaves, jit_id):
    with dispatch_lock:
        return run(*dynamic)


def donating(filter_warning: bool, fun_arrays: bool) -> Callable:
    """`fun_arrays`: whether the function itself holds arrays (`dynamic[0]`)."""

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


def serialize_dispatch(shardings: list) -> bool:
    """Whether calls must launch under `dispatch_lock`: a multi-device sharding on the
    CPU (not one on an abstract mesh: inside a trace the outer call dispatches)."""
    return jax.default_backend() == "cpu" and any(
        isinstance(s, Sharding) and not is_abstract(s) and len(s.device_set) > 1
        for s in shardings
    )
