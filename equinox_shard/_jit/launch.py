"""The launch of a compiled call: its dispatch `dispatch(run, dynamic, deleted, leaves,
jit_id)`, one per entry, stacked by `stack` (in `entry.build_entry` alone) from a
launch (`plain`, `serialized`, or donation's, `donation.Donation.launch`) and the
layers that pacing (`paced`), callbacks (`callbacks.waiting`) and explanations
(`explain_misses.miss`) supply; and the lock that serialises launches (RFC §6)."""

import functools as ft
import itertools
import threading
from collections.abc import Callable, Sequence

import jax
import jax._src.traceback_util as traceback_util
from jax.sharding import Sharding

from .._arrays import is_tracer, on_abstract_mesh


traceback_util.register_exclusion(__file__)


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


# Every PACE-th multi-device launch on the CPU waits for its own outputs, so that at
# most PACE of ours are queued on a device. JAX 0.10.2's CPU client waits for a free
# slot among a device's 32 queued programs on a thread of its pool, which has only as
# many threads as devices on a machine with fewer cores: one thread waiting there, and
# the collective queued first lacks a participant, deadlocks, and XLA aborts the
# process after 40 s (upstream/jax-reports/cpu-inflight-limit-deadlock).
PACE = 8
# Multi-device CPU launches, numbered from 1: `next` on it is atomic (it holds the GIL).
launches = itertools.count(1)


def paced(inner: Callable, run, dynamic, deleted, leaves, jit_id):
    """The dispatch layer (see `stack`) of an entry that launches on several CPU
    devices: `inner`, then, every `PACE`-th launch, a wait for its outputs. The CPU
    client runs multi-device programs one at a time in launch order, so this waits
    for every earlier one too."""
    out = inner(run, dynamic, deleted, leaves, jit_id)
    if next(launches) % PACE == 0:
        # Outside the lock: other threads launch meanwhile. Tracers (an outer trace)
        # and arrays another thread has donated since have nothing to wait for.
        arrays = [
            x
            for x in jax.tree_util.tree_leaves(out)
            if isinstance(x, jax.Array) and not is_tracer(x) and not x.is_deleted()
        ]
        jax.block_until_ready(arrays)
    return out


def serialize_dispatch(shardings: list) -> bool:
    """Whether calls must launch under `dispatch_lock`: a multi-device sharding on the
    CPU (not one on an abstract mesh: inside a trace the outer call dispatches)."""
    return jax.default_backend() == "cpu" and any(
        isinstance(s, Sharding) and not on_abstract_mesh(s) and len(s.device_set) > 1
        for s in shardings
    )


def stack(launch: Callable, layers: Sequence[Callable]) -> Callable | None:
    """The dispatch of an entry: `launch`, wrapped by each of `layers`, innermost
    first (`layer(inner, run, dynamic, deleted, leaves, jit_id)`). `None` for `plain`
    alone: the call then launches `run(*dynamic)` itself, without a frame."""
    dispatch = launch
    for layer in layers:
        dispatch = ft.partial(layer, dispatch)
    return None if dispatch is plain else dispatch
