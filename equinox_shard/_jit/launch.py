"""The launch of a compiled call: its dispatch `dispatch(run, dynamic, deleted, leaves,
jit_id)`, one per entry, stacked by `stack` from a launch (`plain`, `serialized`, or
donation's, `donation.Donation.launch`) and the layers that callbacks
(`callbacks.waiting`) and explanations (`explain_misses.build`) supply; and the lock
that serialises launches (RFC §6)."""

import threading
from collections.abc import Callable, Sequence

import jax
import jax._src.traceback_util as traceback_util
from jax.sharding import Sharding

from .._arrays import on_abstract_mesh


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


def serialize_dispatch(shardings: list) -> bool:
    """Whether calls must launch under `dispatch_lock`: a multi-device sharding on the
    CPU (not one on an abstract mesh: inside a trace the outer call dispatches)."""
    return jax.default_backend() == "cpu" and any(
        isinstance(s, Sharding) and not on_abstract_mesh(s) and len(s.device_set) > 1
        for s in shardings
    )


def launch_for(shardings: list) -> Callable:
    """The launch of an entry that donates nothing: `serialized` where its shardings
    need the lock (`serialize_dispatch`), else `plain`."""
    return serialized if serialize_dispatch(shardings) else plain


def stack(launch: Callable, layers: Sequence[Callable]) -> Callable | None:
    """The dispatch of an entry: `launch`, wrapped by each of `layers`
    (`inner -> dispatch`), innermost first. `None` for `plain` alone: the call then
    launches `run(*dynamic)` itself, without a frame."""
    dispatch = launch
    for layer in layers:
        dispatch = layer(dispatch)
    return None if dispatch is plain else dispatch
