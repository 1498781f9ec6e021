"""An entry's dispatch, `dispatch(call)` for a `cache.Call`: a launch with layers
stacked over it (`stack`), under `dispatch_lock` where it must be (RFC §6)."""

import functools as ft
import itertools
from collections.abc import Callable, Sequence

import jax
import jax._src.traceback_util as traceback_util
from jax.sharding import Sharding

from .._arrays import is_tracer, on_abstract_mesh
from .._dispatch import dispatch_lock


traceback_util.register_exclusion(__file__)


def plain(call):
    return call.run(*call.dynamic)


# Every PACE-th multi-device CPU launch waits for its outputs: with more queued, JAX
# 0.10.2's CPU client can deadlock (upstream/jax-reports/cpu-inflight-limit-deadlock).
PACE = 8
# Multi-device CPU launches, numbered from 1 (`next` is atomic under the GIL).
launches = itertools.count(1)


def paced(inner: Callable, call):
    """The layer of an entry on several CPU devices: every `PACE`-th launch waits."""
    out = inner(call)
    if next(launches) % PACE == 0:
        _wait(out)
    return out


def paced_serialized(call):
    """`paced` over a launch under `dispatch_lock`, in one frame (a multi-device CPU
    entry that donates nothing)."""
    with dispatch_lock:
        if call.structure.deleted(call.leaves):  # donated by another thread since
            raise RuntimeError("An input was donated by another thread.")
        out = call.run(*call.dynamic)
    if next(launches) % PACE == 0:
        _wait(out)
    return out


def paced_run(run: Callable, dynamic: tuple, traced, is_deleted: Callable | None):
    """`paced_serialized` for `filter_jit`'s step 0, which has no `Call`: `traced`
    (`None` for NumPy, never deleted) checked again under the lock."""
    with dispatch_lock:
        if is_deleted is not None and any(map(is_deleted, traced)):
            raise RuntimeError("An input was donated by another thread.")
        out = run(*dynamic)
    if next(launches) % PACE == 0:
        _wait(out)
    return out


def _wait(out) -> None:
    # Outside the lock; tracers and arrays donated since have nothing to wait for.
    arrays = [
        x
        for x in jax.tree_util.tree_leaves(out)
        if isinstance(x, jax.Array) and not is_tracer(x) and not x.is_deleted()
    ]
    jax.block_until_ready(arrays)


def serialize_dispatch(shardings: list) -> bool:
    """Whether calls launch under `dispatch_lock`: several CPU devices."""
    return jax.default_backend() == "cpu" and any(
        isinstance(s, Sharding) and not on_abstract_mesh(s) and len(s.device_set) > 1
        for s in shardings
    )


def stack(launch: Callable, layers: Sequence[Callable]) -> Callable | None:
    """`launch` wrapped by each of `layers`, innermost first; `None` for `plain` alone
    (the call launches `call.run(*call.dynamic)` itself, without a frame)."""
    dispatch = launch
    for layer in layers:
        dispatch = ft.partial(layer, dispatch)
    return None if dispatch is plain else dispatch
