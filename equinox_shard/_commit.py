"""Committing `filter_jit`'s uncommitted inputs to their `in_shardings` before a call.

`jax.jit` compiles uncommitted and committed inputs separately, so `x = f(x)` would
compile twice: once for the uncommitted `x`, once for the committed output fed back.
Placing uncommitted inputs first means `jax.jit` sees committed inputs every time. Where
a sharding spans several processes (`jax.distributed`), host-local values (NumPy
arrays, and arrays on this process's devices) are placed as `filter_device_put` places
them: checked to be the same on every process.
"""

import operator
from collections.abc import Callable

import jax
import jax.core
import numpy as np
from jax.sharding import Sharding

from . import _multiprocess


_committed = operator.attrgetter("committed")


def all_committed(values) -> bool:
    """Whether every value is a committed `jax.Array` (at C speed)."""
    try:
        return all(map(_committed, values))
    except (AttributeError, TypeError):  # NumPy, a tracer, a `ShapeDtypeStruct`
        return False


def commit(
    leaves: list, targets: list[tuple[int, Sharding]], where: Callable[[int], str]
) -> None:
    """Places each uncommitted `leaves[i]` onto `sharding`, for `(i, sharding)` in
    `targets`, in place. A committed array is left as it is (a mismatch is raised by
    `_checks.raise_if_committed_elsewhere`). The copies are never returned to the
    caller, so they may share buffers with their source."""
    multiprocess = any(not s.is_fully_addressable for _, s in targets)
    todo = []
    for i, sharding in targets:
        x = leaves[i]
        if isinstance(x, jax.core.Tracer):
            continue
        if (isinstance(x, jax.Array) and not x.committed) or (
            multiprocess and isinstance(x, (np.ndarray, np.generic))
        ):
            todo.append((i, sharding))
    if not todo:
        return
    indices = [i for i, _ in todo]
    shardings = [s for _, s in todo]
    if multiprocess:
        indices, shardings = _multiprocess.place_host_local(
            leaves, indices, shardings, where
        )
    if indices:
        moved = jax.device_put([leaves[i] for i in indices], shardings)
        for i, x in zip(indices, moved):
            leaves[i] = x
