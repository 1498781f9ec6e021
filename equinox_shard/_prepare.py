"""What happens to a `filter_jit` call's inputs between the cache look-up and `jax.jit`:
the checks that must run before anything executes, private copies for donation, and
placing inputs on their `in_shardings`.

`in_shardings` is the request to place: an input that is not yet there (uncommitted, or
committed elsewhere) is moved first, so that `jax.jit` always sees inputs on their
shardings, `x = f(x)` compiles once, and a committed input is moved where plain
`jax.jit` would refuse (the same devices, another sharding). A move of an input that
is not donated is a copy: the caller's array stays alive and unchanged. A donated input
that moves is freed where `jax.jit` frees it: when the move hands back all of its
buffers (onto its own device, or replicated over devices that include its own),
donating the moved array deletes the caller's; otherwise the caller's stays. Where a
sharding spans several processes (`jax.distributed`), host-local values are placed as
`filter_device_put` places them: checked to be the same on every process.
"""

import operator
from collections.abc import Callable, Collection
from typing import Any

import jax
import jax._src.traceback_util as traceback_util
import jax.core
import numpy as np
from jax.sharding import Sharding

from . import _checks, _donate, _multiprocess
from ._place import is_placed
from ._spec import is_abstract


traceback_util.register_exclusion(__file__)


def prepare(dynamic_fun, cache, entry, layout, args, kwargs, leaves) -> tuple:
    """Checks and placements before execution: returns the leaves as placed and the
    dynamic trees to call. `layout` is the one of this call's leaf types, which tests
    for deleted inputs: an entry is shared by layouts that differ in them (arrays,
    tracers, NumPy); its own layout packs the leaves as its function unpacks them."""
    # XLA crashes on a deleted multi-device input, donated or not.
    if layout.deleted(leaves):
        _donate.raise_if_deleted(leaves, layout.dynamic, _where(cache, args, kwargs))
    layout = entry.layout
    placed = leaves
    if entry.donates:
        fun = dynamic_fun if cache.donate_rest else None
        where = _where(cache, args, kwargs)
        placed = _donate.keep_undonated(
            leaves, layout.donated, layout.dynamic, fun, where, cache.fun_name
        )
    if entry.targets and not all_placed(entry.get_targets(placed), entry.placed):
        placed = list(placed)
        donated = layout.donated if entry.donates else ()
        try:
            commit(placed, entry.targets, _where(cache, args, kwargs), donated)
        except Exception:
            # The entry was checked for the shapes of the call that made it.
            _checks.diagnose(cache, args, kwargs, placed, layout.dynamic, entry.targets)
            raise
    if not layout.packing.trivial:
        return placed, (dynamic_fun, *layout.packing.pack(placed))
    if placed is not leaves:
        args, kwargs = layout.treedef.unflatten(placed)
    return placed, (dynamic_fun, kwargs, *args)


def _where(cache, args, kwargs) -> Callable[[int], str]:
    return lambda i: _checks.arg_path(cache.names, args, kwargs, i)


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
    buffers with their source; a donated one shares all of them or none."""
    # Inside a trace (a sharding on the abstract mesh), the enclosing call places.
    targets = [(i, s) for i, s in targets if not is_abstract(s)]
    multiprocess = any(not s.is_fully_addressable for _, s in targets)
    donated = frozenset(donated)
    todo: list[tuple[int, Any]] = []
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
    # A donated input is freed where `jax.jit` frees it: where the move hands back all
    # of its buffers, donating the result deletes it. Where the move would reuse only
    # some, it is first copied where it is, so that donating frees only the copy.
    private = [
        i
        for i, s in zip(indices, shardings)
        if i in donated
        and _donate.shares_source_buffer(leaves[i], s)
        and not _donate.reuses_every_buffer(leaves[i], s)
    ]
    if private:
        _donate.private_copies(leaves, private)
    if indices:
        moved = jax.device_put([leaves[i] for i in indices], shardings)
        for i, x in zip(indices, moved):
            leaves[i] = x
