"""Global arrays from host-local values, checked identical across processes."""

import functools as ft
import hashlib
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, Sharding

from ._arrays import is_concrete, is_key_array, NUMPY, raise_if_deleted


def is_host_local(x: Any) -> bool:
    """Whether `x` is a concrete array whose whole value lives in this process."""
    return isinstance(x, NUMPY) or (is_concrete(x) and x.is_fully_addressable)


def to_host(x: Any, where: Callable[[], str]) -> tuple[np.ndarray, Any]:
    """The host copy of `x` in a JAX dtype, and its PRNG implementation (or `None`)."""
    impl = None
    if isinstance(x, jax.Array):
        raise_if_deleted([x], (0,), lambda _: where(), then=", so it cannot be placed")
        if is_key_array(x):
            impl = jax.random.key_impl(x)
            x = jax.random.key_data(x)
    data = np.asarray(x)
    return data.astype(jax.dtypes.canonicalize_dtype(data.dtype), copy=False), impl


def processes_of(sharding: Sharding) -> frozenset[int]:
    return frozenset(d.process_index for d in sharding.device_set)


def _hash64(data: bytes) -> np.ndarray:
    return np.frombuffer(hashlib.blake2b(data, digest_size=8).digest(), np.uint32)


def _differs(rows: np.ndarray) -> list[int]:
    """The processes whose row differs from process 0's."""
    return [p for p in range(len(rows)) if not np.array_equal(rows[p], rows[0])]


def check_identical(items: list[tuple[str, np.ndarray, Any, Sharding]]) -> None:
    """Raises naming the first key path whose value, shape, dtype or sharding differs
    between processes: one allgather of three `uint32`s (a second to name it)."""
    per_leaf = np.empty((len(items), 4), np.uint32)  # structure, then content
    for k, (path, data, impl, sharding) in enumerate(items):
        # A `NamedSharding`'s repr leaves out the order of its mesh's devices.
        if isinstance(sharding, NamedSharding):
            ids = np.asarray(sharding.mesh.device_ids).ravel().tolist()
        else:
            ids = sorted(d.id for d in sharding.device_set)
        identity = repr((ids, repr(sharding)))
        description = repr((path, data.shape, str(data.dtype), str(impl), identity))
        per_leaf[k, :2] = _hash64(description.encode())
        per_leaf[k, 2:] = _hash64(np.ascontiguousarray(data).tobytes())
    summary = np.append(np.uint32(len(items)), _hash64(per_leaf.tobytes()))
    rows = multihost_utils.process_allgather(summary)
    if not _differs(rows):
        return
    counts = rows[:, 0]
    if len(set(counts.tolist())) > 1:
        counts = ", ".join(f"process {p}: {n}" for p, n in enumerate(counts))
        raise ValueError(
            "The processes disagree on how many arrays to place across processes "
            f"({counts}), starting with {items[0][0] if items else 'none'} here. Every "
            "process must make the same call, with PyTrees of the same structure and "
            "shardings."
        )
    per_leaf = multihost_utils.process_allgather(per_leaf)
    for k, (path, data, _, sharding) in enumerate(items):
        bad = _differs(per_leaf[:, k, :2])
        if bad:
            raise ValueError(
                f"{path}: the key path, shape, dtype or sharding of this array differs "
                f"between processes (processes {bad} differ from process 0, which has "
                f"shape {data.shape}, dtype {data.dtype}, sharding {sharding}). Every "
                "process must make the same call, with PyTrees of the same structure "
                "and shardings."
            )
        bad = _differs(per_leaf[:, k, 2:])
        if bad:
            raise ValueError(
                f"{path}: this array must have the same value on every process (its "
                f"sharding {sharding} spans all {len(per_leaf)} processes, and each "
                "process supplies the whole array), but processes "
                f"{bad} hold a different value from process 0. Compute it the same way "
                "everywhere (e.g. from the same PRNG key), or, if each process holds "
                "its own part of the array, use "
                "`equinox_shard.filter_make_array_from_process_local_data`."
            )
    raise AssertionError  # pragma: no cover - a summary differed, so some item did.


def place_host_local(
    leaves: list,
    indices: list[int],
    targets: list[Sharding],
    where: Callable[[int], str],
) -> tuple[list[int], list[Sharding]]:
    """Places each host-local array whose target spans processes, from its host copy
    (checked identical where it spans all); returns what is left to place."""
    rest_indices, rest_targets, mine = [], [], []
    for i, sharding in zip(indices, targets):
        if sharding.is_fully_addressable or not is_host_local(leaves[i]):
            rest_indices.append(i)
            rest_targets.append(sharding)
        else:
            mine.append((i, sharding, *to_host(leaves[i], lambda i=i: where(i))))
    if not mine:
        return indices, targets
    everyone = frozenset(range(jax.process_count()))
    # One pass over a large mesh's devices per sharding, not per leaf.
    spans_everyone = ft.cache(lambda sharding: processes_of(sharding) == everyone)
    checked = [(where(i), d, impl, s) for i, s, d, impl in mine if spans_everyone(s)]
    if checked:
        check_identical(checked)
    for i, sharding, data, impl in mine:
        get = lambda index, d=data: np.asarray(d[index])
        out = jax.make_array_from_callback(data.shape, sharding, get, dtype=data.dtype)
        leaves[i] = out if impl is None else jax.random.wrap_key_data(out, impl=impl)
    return rest_indices, rest_targets
