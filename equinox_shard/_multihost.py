"""Several processes (`jax.distributed`): global arrays from host-local values that
every process holds whole (`place_host_local`, checked identical by one small collective
of fingerprints); the per-process parts are `_process_local_data`'s."""

import hashlib
from collections.abc import Callable
from typing import Any

import jax
import jax._src.traceback_util as traceback_util
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, Sharding

from ._arrays import is_concrete, is_key_array, NUMPY, raise_if_deleted


traceback_util.register_exclusion(__file__)


#
# Host-local values.
#


def is_host_local(x: Any) -> bool:
    """Whether `x` is a concrete array whose whole value lives in this process."""
    if isinstance(x, NUMPY):
        return True
    if is_concrete(x):
        return x.is_fully_addressable
    return False


def to_host(x: Any, where: Callable[[], str]) -> tuple[np.ndarray, Any]:
    """A host-local array as NumPy, in a dtype JAX uses, and its PRNG implementation
    (or `None`)."""
    impl = None
    if isinstance(x, jax.Array):
        raise_if_deleted([x], (0,), lambda _: where(), then=", so it cannot be placed")
        if is_key_array(x):
            impl = jax.random.key_impl(x)
            x = jax.random.key_data(x)
    data = np.asarray(x)
    dtype = jax.dtypes.canonicalize_dtype(data.dtype)
    if data.dtype != dtype:
        data = data.astype(dtype)
    return data, impl


def from_host(data: np.ndarray, sharding: Sharding, impl: Any) -> jax.Array:
    out = jax.make_array_from_callback(
        data.shape, sharding, lambda index: np.asarray(data[index]), dtype=data.dtype
    )
    if impl is not None:
        out = jax.random.wrap_key_data(out, impl=impl)
    return out


def processes_of(sharding: Sharding) -> frozenset[int]:
    return frozenset(d.process_index for d in sharding.device_set)


def _hash64(*parts: bytes) -> np.ndarray:
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        h.update(part)
    return np.frombuffer(h.digest(), dtype=np.uint32)


def _sharding_identity(sharding: Sharding) -> str:
    if isinstance(sharding, NamedSharding):
        mesh = sharding.mesh
        return repr(
            (
                "NamedSharding",
                dict(mesh.shape),
                tuple(int(i) for i in np.asarray(mesh.device_ids).flat),
                tuple(str(t) for t in mesh.axis_types),
                str(sharding.spec),
                sharding.memory_kind,
            )
        )
    ids = sorted(d.id for d in sharding.device_set)
    return repr((type(sharding).__name__, ids, repr(sharding)))


def _allgather(x: np.ndarray) -> np.ndarray:
    """`x` from every process, stacked along a new leading axis: a collective."""
    return np.asarray(multihost_utils.process_allgather(x, tiled=False))


def _differs(rows: np.ndarray) -> list[int]:
    """The processes whose row differs from process 0's."""
    return [p for p in range(len(rows)) if not np.array_equal(rows[p], rows[0])]


def check_identical(items: list[tuple[str, np.ndarray, Any, Sharding]]) -> None:
    """Raises naming the first key path whose value, shape, dtype or sharding differs
    between processes: one allgather of five `uint32`s (a second to name it)."""
    structure = np.empty((len(items), 2), np.uint32)
    content = np.empty((len(items), 2), np.uint32)
    for k, (path, data, impl, sharding) in enumerate(items):
        description = (path, data.shape, str(data.dtype), str(impl))
        structure[k] = _hash64(
            repr(description).encode(), _sharding_identity(sharding).encode()
        )
        content[k] = _hash64(np.ascontiguousarray(data).tobytes())
    summary = np.concatenate(
        [
            np.array([len(items)], np.uint32),
            _hash64(structure.tobytes()),
            _hash64(content.tobytes()),
        ]
    )
    rows = _allgather(summary)
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
    per_leaf = _allgather(np.concatenate([structure, content], axis=1))
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
    """Places each host-local array whose target spans several processes, in place,
    built from its host copy (no compiled collective, unlike `jax.device_put`), after
    `check_identical` where it spans them all; returns what is left to place."""
    rest_indices, rest_targets, mine = [], [], []
    for i, sharding in zip(indices, targets):
        if sharding.is_fully_addressable or not is_host_local(leaves[i]):
            rest_indices.append(i)
            rest_targets.append(sharding)
        else:
            mine.append((i, sharding))
    if not mine:
        return indices, targets
    everyone = frozenset(range(jax.process_count()))
    spans_everyone = {}  # by sharding: one pass over a large mesh's devices
    host = []
    checked = []
    for i, sharding in mine:
        data, impl = to_host(leaves[i], lambda i=i: where(i))
        host.append((data, impl))
        try:
            everywhere = spans_everyone[sharding]
        except KeyError:
            everywhere = spans_everyone[sharding] = processes_of(sharding) == everyone
        if everywhere:
            checked.append((where(i), data, impl, sharding))
    if checked:
        check_identical(checked)
    for (i, sharding), (data, impl) in zip(mine, host):
        leaves[i] = from_host(data, sharding, impl)
    return rest_indices, rest_targets
