"""JAX's multi-controller runtime (`jax.distributed`): one process per host, and global
shardings whose devices are not all addressable from any one process.

There are two ways to build a global array from host-local values, both filtered:

- every process holds the *whole* value (replicated parameters, an optimiser state):
    [`equinox_shard.filter_device_put`][] with the global sharding. Every process must
    pass the same value; this is checked with one small collective (a fingerprint per
    array), and a difference is reported by key path (`place_host_local`).
- every process holds *its own part* of the value (its share of a batch):
    [`equinox_shard.filter_make_array_from_process_local_data`][], the filtered
    version of `jax.make_array_from_process_local_data`.

Everything here is SPMD: every process must make the same calls, with PyTrees of the
same structure, shapes, dtypes and shardings, in the same order, as for any collective
operation in multi-controller JAX.
"""

import hashlib
from collections.abc import Callable
from typing import Any

import jax
import jax.core
import jax.tree_util as jtu
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, Sharding
from jaxtyping import PyTree

from . import _sharding
from ._spec import check, leaf_path


#
# Host-local values.
#


def _is_key(x: Any) -> bool:
    return jax.numpy.issubdtype(x.dtype, jax.dtypes.prng_key)


def is_host_local(x: Any) -> bool:
    """Whether `x` is a concrete array whose whole value lives in this process: a NumPy
    array or scalar, or a `jax.Array` whose devices are all addressable from here
    (committed or not). Such a value can only be turned into an array spanning several
    processes by building that array from its pieces, process by process."""
    if isinstance(x, (np.ndarray, np.generic)):
        return True
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        return x.is_fully_addressable
    return False


def _to_host(x: Any, where: Callable[[], str]) -> tuple[np.ndarray, Any]:
    """Returns the value of a host-local array as a NumPy array of a dtype JAX uses (as
    `jax.device_put` would make it), and the PRNG implementation if `x` is a typed key
    array (whose data is then the `uint32` key data)."""
    impl = None
    if isinstance(x, jax.Array):
        if x.is_deleted():
            raise RuntimeError(
                f"{where()}: this array has been deleted (was it donated to an earlier "
                "call?), so it cannot be placed."
            )
        if _is_key(x):
            impl = jax.random.key_impl(x)
            x = jax.random.key_data(x)
    data = np.asarray(x)
    dtype = jax.dtypes.canonicalize_dtype(data.dtype)
    if data.dtype != dtype:
        data = data.astype(dtype)
    return data, impl


def _from_host(data: np.ndarray, sharding: Sharding, impl: Any) -> jax.Array:
    out = jax.make_array_from_callback(
        data.shape, sharding, lambda index: np.asarray(data[index]), dtype=data.dtype
    )
    if impl is not None:
        out = jax.random.wrap_key_data(out, impl=impl)
    return out


def _processes(sharding: Sharding) -> frozenset[int]:
    return frozenset(d.process_index for d in sharding.device_set)


#
# Checking that every process holds the same value: one collective of fingerprints.
#


def _digest(*parts: bytes) -> np.ndarray:
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        h.update(part)
    return np.frombuffer(h.digest(), dtype=np.uint32)


def _describe_sharding(sharding: Sharding) -> str:
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
    """Raises a `ValueError` naming the first key path whose value (or shape, dtype or
    sharding) differs between processes, for `items` of `(key path, host data, PRNG
    implementation or None, sharding)`.

    Costs one `multihost_utils.process_allgather` of five `uint32`s per call (and a
    second, of four `uint32`s per item, only to name the culprit), plus hashing the
    data on the host. Every process must call this with the same number of items.
    """
    structure = np.empty((len(items), 2), np.uint32)
    content = np.empty((len(items), 2), np.uint32)
    for k, (path, data, impl, sharding) in enumerate(items):
        description = (path, data.shape, str(data.dtype), str(impl))
        structure[k] = _digest(
            repr(description).encode(), _describe_sharding(sharding).encode()
        )
        content[k] = _digest(np.ascontiguousarray(data).tobytes())
    summary = np.concatenate(
        [
            np.array([len(items)], np.uint32),
            _digest(structure.tobytes()),
            _digest(content.tobytes()),
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


#
# `filter_device_put` onto shardings that span several processes.
#


def place_host_local(
    leaves: list,
    indices: list[int],
    targets: list[Sharding],
    where: Callable[[int], str],
) -> tuple[list[int], list[Sharding]]:
    """The multi-process branch of placing arrays (`filter_device_put`, and committing
    `filter_jit`'s arguments): for each `leaves[i]`, `targets[i]` in `indices`,
    `targets`, places every host-local array (see `is_host_local`) whose target
    sharding is not fully addressable, in place in `leaves`, and returns the
    `(indices, targets)` left for `jax.device_put`. `where(i)` is the key path of
    `leaves[i]`, for error messages.

    Each such array must be identical on every process its sharding spans: for those
    whose sharding spans every process, this is checked by `check_identical` (one small
    collective) before anything is placed, and a difference is reported by key path.
    The arrays are then built with `jax.make_array_from_callback` from the host copy of
    each value: no further collective and no compilation. (`jax.device_put` instead
    gathers every array from every process to compare them, with one compiled
    collective per array and an error that names no array; and it refuses committed
    arrays and PRNG key arrays onto such shardings.)

    Shardings that span only some processes are not checked (as in `jax.device_put`: a
    process outside the sharding contributes nothing), and a process none of whose
    devices is in the sharding gets an array with no addressable shards.
    """
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
        data, impl = _to_host(leaves[i], lambda i=i: where(i))
        host.append((data, impl))
        try:
            everywhere = spans_everyone[sharding]
        except KeyError:
            everywhere = spans_everyone[sharding] = _processes(sharding) == everyone
        if everywhere:
            checked.append((where(i), data, impl, sharding))
    if checked:
        check_identical(checked)
    for (i, sharding), (data, impl) in zip(mine, host):
        leaves[i] = _from_host(data, sharding, impl)
    return rest_indices, rest_targets


#
# Per-process parts of a global array.
#


def _is_shape(x: Any) -> bool:
    return x is None or (
        isinstance(x, tuple) and all(isinstance(d, int) for d in x)  # pyright: ignore
    )


def _broadcast_shapes(global_shape: Any, local_data: Any, n: int) -> list:
    if _is_shape(global_shape):
        return [global_shape] * n
    shape_leaves, shape_def = jtu.tree_flatten(global_shape, is_leaf=_is_shape)
    for leaf in shape_leaves:
        if not _is_shape(leaf):
            raise TypeError(
                "`global_shape` must be None, a shape (a tuple of ints), or a PyTree "
                f"prefix of `local_data` whose leaves are those; got a leaf {leaf!r}."
            )
    try:
        subtrees = shape_def.flatten_up_to(local_data)
    except (ValueError, TypeError):
        raise ValueError(
            "`global_shape` must be None, a shape (a tuple of ints), or a PyTree "
            f"prefix of `local_data`; got {global_shape!r} for a `local_data` of "
            f"structure {jtu.tree_structure(local_data)}."
        ) from None
    out = []
    for shape, subtree in zip(shape_leaves, subtrees):
        out.extend([shape] * len(jtu.tree_leaves(subtree)))
    return out


def filter_make_array_from_process_local_data(
    shardings: Any,
    local_data: PyTree[Any],
    global_shape: Any = None,
) -> PyTree[Any]:
    """Filtered version of `jax.make_array_from_process_local_data`: builds global
    arrays (spanning several processes) from the part of each array that this process
    holds, e.g. its share of a batch; every non-array leaf comes back as the very same
    object.

    This is the multi-process counterpart of [`equinox_shard.filter_device_put`][] for
    values that *differ* between processes. (Values that are the same on every process,
    such as a model's parameters, are placed with `filter_device_put` itself.)

    **Arguments:**

    - `shardings`: a PyTree prefix of `local_data`, in the specification language of
        [`equinox_shard.filter_device_put`][]: `jax.sharding.Sharding`, `jax.Device`,
        bare `PartitionSpec` (with `jax.set_mesh`), `None` (leave that subtree as it
        is), or a callable `leaf -> spec` (called with the *local* array).
    - `local_data`: any PyTree. Its array leaves (`equinox.is_array`: NumPy arrays,
        `jax.Array`s whose devices are all in this process, typed PRNG key arrays) are
        this process's parts; other leaves are returned as-is.
    - `global_shape`: the shape of each global array, as in JAX: `None` (the default)
        infers it from the local shape and the sharding, assuming each process holds
        only its own part along every dimension split across processes. Otherwise a
        shape (a tuple of ints) for every array, or a PyTree prefix of `local_data`
        whose leaves are shapes or `None`.

    **Returns:**

    A PyTree with the structure of `local_data`: each array leaf with a specification
    becomes a `jax.Array` of its global shape with its sharding; other leaves are the
    same objects, and so does a global array that already carries its sharding. In a
    single-process run this is `filter_device_put` (and `global_shape` must be `None`
    or the local shape).

    **Raises:**

    A `ValueError` naming the key path (`local_data['x']`): for a specification that is
    not a prefix, a rank or divisibility mismatch, a local shape that is neither the
    global shape nor this process's share of it, a sharding with no device in this
    process, and for an array that every process holds whole (its global shape is its
    local shape, and its sharding spans every process), if it differs between
    processes: checked with one small collective (a fingerprint per array, only when
    there are such arrays).

    !!! info "How local parts are laid out"

        Exactly as `jax.make_array_from_process_local_data`, which this calls for every
        array: along a dimension split across processes, a process's part is the
        concatenation, in order, of the slices its devices hold. For the usual data
        parallelism (`P("data")` over a mesh whose devices are ordered process by
        process, as `jax.make_mesh` orders them), process `p` of `n` holds rows
        `p * B // n` to `(p + 1) * B // n` of the global batch of `B` rows.

    !!! example

        ```python
        jax.distributed.initialize(...)  # one process per host
        mesh = jax.make_mesh(
            (jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,)
        )
        batch = jax.NamedSharding(mesh, jax.P("data"))
        # Each process loads its own 32 rows; the global batch has 32 * process_count.
        x, y = eqxs.filter_make_array_from_process_local_data(batch, (x_local, y_local))
        ```
    """
    leaves, treedef = jtu.tree_flatten(local_data)
    todo = _sharding.resolve_leaves(
        local_data,
        leaves,
        shardings,
        "shardings",
        "local_data",
        abstract_ok=False,
    )
    if not todo:
        return local_data
    shapes = _broadcast_shapes(global_shape, local_data, len(leaves))
    if jax.process_count() == 1:
        for i, _ in todo:
            shape = shapes[i]
            if shape is not None and tuple(shape) != np.shape(leaves[i]):
                raise ValueError(
                    f"{leaf_path(local_data, i, 'local_data')}: in a single-process "
                    "run, `global_shape` must be None or the local shape "
                    f"{np.shape(leaves[i])}; got {shape}."
                )
        _sharding.device_put_leaves(local_data, leaves, todo, "local_data")
        return jtu.tree_unflatten(treedef, leaves)
    me = jax.process_index()
    everyone = frozenset(range(jax.process_count()))
    checked = []
    for i, sharding in todo:
        where = lambda i=i: leaf_path(local_data, i, "local_data")
        leaf = leaves[i]
        if not is_host_local(leaf):
            if (
                isinstance(leaf, jax.Array)
                and leaf.committed
                and leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
            ):
                continue  # Already this global array: the same object.
            raise ValueError(
                f"{where()}: expected this process's part of the array, as a NumPy "
                "array or a `jax.Array` on this process's devices; got an array "
                "spanning devices of other processes. Use "
                "`equinox_shard.filter_device_put` to reshard a global array."
            )
        processes = _processes(sharding)
        if me not in processes:
            raise ValueError(
                f"{where()}: the sharding {sharding} has no device in this process "
                f"(process {me}; its devices belong to processes "
                f"{sorted(processes)}), so this process has no part of the array to "
                "give. Use a sharding whose mesh includes every calling process's "
                "devices."
            )
        local_shape = np.shape(leaf)
        if isinstance(sharding, NamedSharding) and len(sharding.spec) > len(
            local_shape
        ):
            check(local_shape, sharding, where)  # Raises the rank error.
        data, impl = _to_host(leaf, where)
        shape = shapes[i]
        if shape is not None and impl is not None:
            shape = tuple(shape) + data.shape[-1:]  # The key data's trailing axis.
        try:
            out = jax.make_array_from_process_local_data(sharding, data, shape)
        except ValueError as e:
            raise ValueError(f"{where()}: {e}") from e
        if out.shape == data.shape and processes == everyone:
            checked.append((where(), data, impl, sharding))
        if impl is not None:
            out = jax.random.wrap_key_data(out, impl=impl)
        leaves[i] = out
    if checked:
        check_identical(checked)
    return jtu.tree_unflatten(treedef, leaves)
