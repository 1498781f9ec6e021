"""Placing `filter_jit`'s inputs on their `in_shardings` before a call.

`in_shardings` is the request to place: an input that is not yet there (uncommitted, or
committed elsewhere) is moved first, so that `jax.jit` always sees inputs on their
shardings, `x = f(x)` compiles once, and a committed input is moved where plain
`jax.jit` would refuse (the same devices, another sharding). A move is a copy: the
caller's array stays alive and unchanged. A donated input that moves is copied into
buffers of its own, and the copy is donated. Where a sharding spans several processes
(`jax.distributed`), host-local values are placed as `filter_device_put` places them:
checked to be the same on every process.
"""

import operator
from collections.abc import Callable, Collection

import jax
import jax.core
import numpy as np
from jax.sharding import Sharding

from . import _multiprocess
from ._place import is_placed, private_copies, shares_source_buffer
from ._spec import is_abstract


_placement = operator.attrgetter("committed", "sharding")


def all_placed(values, expected: tuple) -> bool:
    """Whether every value is a committed `jax.Array` whose sharding equals its target,
    `expected` holding `(True, sharding)` per value (one C-speed pass). `False` means
    `commit` must look: `jax.jit` may not be given an array on another sharding
    (upstream/jax-reports/jit-committed-device-order)."""
    try:
        return all(map(operator.eq, map(_placement, values), expected))
    except (AttributeError, TypeError):  # NumPy, a tracer, a `ShapeDtypeStruct`
        return False


def commit(
    leaves: list,
    targets: list[tuple[int, Sharding]],
    where: Callable[[int], str],
    donated: Collection[int] = (),
) -> None:
    """Places each `leaves[i]` that is not on `sharding` onto it, for `(i, sharding)` in
    `targets`, in place. The copies are never returned to the caller, so they may share
    buffers with their source, except those in `donated`, which share none."""
    # Inside a trace (a sharding on the abstract mesh), the enclosing call places.
    targets = [(i, s) for i, s in targets if not is_abstract(s)]
    multiprocess = any(not s.is_fully_addressable for _, s in targets)
    donated = frozenset(donated)
    todo = []
    for i, sharding in targets:
        x = leaves[i]
        if isinstance(x, jax.core.Tracer):
            continue
        if isinstance(x, jax.Array):
            if not (x.committed and is_placed(x, sharding)):
                todo.append((i, sharding))
        elif multiprocess and isinstance(x, (np.ndarray, np.generic)):
            todo.append((i, sharding))
    if not todo:
        return
    indices = [i for i, _ in todo]
    shardings = [s for _, s in todo]
    if multiprocess:
        indices, shardings = _multiprocess.place_host_local(
            leaves, indices, shardings, where
        )
    # `jax.device_put` may hand back a source buffer as a shard of its result
    # (upstream/jax-reports/device-put-may-alias-replicated): a donated input is
    # first copied where it is, so that donating the result frees only the copy.
    private = [
        i
        for i, s in zip(indices, shardings)
        if i in donated and shares_source_buffer(leaves[i], s)
    ]
    if private:
        private_copies(leaves, private)
    if indices:
        moved = jax.device_put([leaves[i] for i in indices], shardings)
        for i, x in zip(indices, moved):
            leaves[i] = x
