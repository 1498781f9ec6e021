"""Placing the array leaves of a PyTree with `jax.device_put`, keeping every buffer
that the caller did not donate (RFC §6): where JAX would hand back a buffer of the
source, or free one it was not given, the source is copied first or not donated."""

from typing import Any

import jax
import jax.core
from jax.sharding import (
    AxisType,
    NamedSharding,
    PartitionSpec,
    Sharding,
    SingleDeviceSharding,
)

from . import _multiprocess
from ._spec import check, leaf_path


_UNCONSTRAINED = PartitionSpec.UNCONSTRAINED


def _without_unconstrained(sharding: NamedSharding) -> NamedSharding:
    spec = PartitionSpec(
        *(None if entry is _UNCONSTRAINED else entry for entry in sharding.spec)
    )
    return NamedSharding(sharding.mesh, spec, memory_kind=sharding.memory_kind)


def is_default_memory(sharding: Sharding) -> bool:
    return sharding.memory_kind in (None, "device")


def same_mesh(current: Sharding, target: Sharding) -> bool:
    """Whether an array placed on `current` may stand for one placed on `target`, given
    that the two are equivalent: the mesh is part of an array's type (Explicit axes
    appear in it, and JAX requires the inputs of one computation to share a mesh), so
    an equivalent sharding over another mesh, or over other axis types, is not enough.
    """
    current_named = isinstance(current, NamedSharding)
    target_named = isinstance(target, NamedSharding)
    if current_named and target_named:
        return current.mesh == target.mesh  # pyright: ignore[reportAttributeAccessIssue]
    if current_named or target_named:
        named = current if current_named else target
        return AxisType.Explicit not in named.mesh.axis_types  # pyright: ignore
    return True


def is_placed(x: jax.Array, sharding: Sharding) -> bool:
    """Whether the committed array `x` may stand for one placed on `sharding`."""
    current = x.sharding
    if current == sharding:
        return True
    try:
        return current.is_equivalent_to(sharding, x.ndim) and same_mesh(
            current, sharding
        )
    except Exception:  # Not equivalent; a later `check` names the problem if any.
        return False


def raise_if_deleted(value: Any, leaves: list, indices, value_name: str) -> None:
    """Raises `RuntimeError`, naming the key path, if `leaves[i]` for any `i` in
    `indices` is a deleted (e.g. donated) array."""
    for i in indices:
        leaf = leaves[i]
        if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
            if leaf.is_deleted():  # pyright: ignore[reportAttributeAccessIssue]
                raise RuntimeError(
                    f"{leaf_path(value, i, value_name)}: this array has been deleted "
                    "(was it donated to an earlier call?), so it cannot be placed."
                )


def shares_source_buffer(leaf: Any, sharding: Sharding) -> bool:
    """Whether `jax.device_put(leaf, sharding, may_alias=False)` may still hand back one
    of `leaf`'s own buffers as a shard of the result. JAX reuses a buffer wherever the
    result's shard on a device is exactly `leaf`'s shard on that device (a
    single-device array onto a replicated sharding; a replicated array onto one of its
    devices), whatever `may_alias` says: upstream/jax-reports/
    device-put-may-alias-replicated."""
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


def _is_key_array(x: Any) -> bool:
    return isinstance(x, jax.Array) and jax.numpy.issubdtype(
        x.dtype, jax.dtypes.prng_key
    )


def _is_committed_array(x: Any) -> bool:
    return (
        isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.committed  # pyright: ignore[reportAttributeAccessIssue]
    )


def private_copies(leaves: list, indices: list[int]) -> None:
    """Replaces each `leaves[i]`, `i` in `indices`, by a copy with the same sharding
    that shares no buffer with it.
    """
    copies = jax.device_put(
        [leaves[i] for i in indices],
        [leaves[i].sharding for i in indices],
        may_alias=False,
    )
    for i, x in zip(indices, copies):
        leaves[i] = x


def device_put_leaves(
    value: Any,
    leaves: list,
    todo: list[tuple[int, Sharding]],
    value_name: str,
    *,
    donate: list | bool | None = False,
    may_alias: list | bool | None = None,
) -> None:
    """Places `leaves[i]` on `sharding` for each `(i, sharding)` in `todo` with one
    batched `jax.device_put`, in place. Arrays that already carry an equivalent
    sharding are left as the same object (unless `may_alias=False`). Every other
    result owns its buffers, unless donated or `may_alias=True`: donating it later
    never deletes the input."""
    indices = []
    targets = []
    for i, sharding in todo:
        leaf = leaves[i]
        if isinstance(sharding, NamedSharding) and _UNCONSTRAINED in sharding.spec:
            # A transfer needs a concrete layout: an unconstrained dimension (which
            # only a compiler can choose) is placed replicated, as eager
            # `with_sharding_constraint` (an identity `jit`) does.
            sharding = _without_unconstrained(sharding)
        flag = may_alias if not isinstance(may_alias, list) else may_alias[i]
        if flag is not False and _is_committed_array(leaf):
            if leaf.is_deleted():
                raise_if_deleted(value, leaves, (i,), value_name)
            if is_placed(leaf, sharding):
                continue
        check(leaf.shape, sharding, lambda i=i: leaf_path(value, i, value_name))
        indices.append(i)
        targets.append(sharding)
    if not indices:
        return
    # Before any transfer, so that a failure cannot leave earlier leaves donated.
    raise_if_deleted(value, leaves, indices, value_name)
    if jax.process_count() > 1:
        # Host-local arrays onto shardings that span several processes.
        indices, targets = _multiprocess.place_host_local(
            leaves, indices, targets, lambda i: leaf_path(value, i, value_name)
        )
        if not indices:
            return
    if isinstance(donate, list):
        donate = [donate[i] for i in indices]
    # A result owns its buffers unless the caller donated the input or allowed
    # aliasing with `may_alias=True`; `None` therefore means "copy unless donated".
    if isinstance(may_alias, list) or isinstance(donate, list):
        flags = [
            may_alias[i] if isinstance(may_alias, list) else may_alias for i in indices
        ]
        donated = donate if isinstance(donate, list) else [donate] * len(indices)
        may_alias = [
            None if d and f is None else bool(f) for f, d in zip(flags, donated)
        ]
        copy = [f is False for f in may_alias]
    else:
        may_alias = None if donate and may_alias is None else bool(may_alias)
        copy = [may_alias is False] * len(indices)
    sources = [leaves[i] for i in indices]
    early = [
        k
        for k, (x, t) in enumerate(zip(sources, targets))
        if copy[k] and shares_source_buffer(x, t)
    ]
    if early:
        # A private copy on the source device first, whose buffer may then be shared.
        private_copies(sources, early)
    if donate is not False and any(map(_is_key_array, sources)):
        # Donating a typed PRNG key array to `jax.device_put` frees it without
        # marking it deleted, so touching it afterwards segfaults (JAX 0.10.2 and
        # 0.12): upstream/jax-reports/device-put-donate-single-device-sharding.
        # Donation is best-effort: key arrays are never donated here.
        flags = donate if isinstance(donate, list) else [donate] * len(sources)
        donate = [d and not _is_key_array(x) for d, x in zip(flags, sources)]
        if not isinstance(may_alias, list):
            may_alias = [may_alias] * len(sources)
        may_alias = [
            False if f is None and not d else f for f, d in zip(may_alias, donate)
        ]
    if donate is not False:
        # JAX 0.10.2: donating to a `SingleDeviceSharding` frees the input without
        # marking it deleted, so touching it afterwards segfaults; donating to the
        # `jax.Device` itself is handled correctly. See `tests/test_jax_facts.py::`
        # `test_device_put_donate_to_single_device_sharding_crashes`.
        targets = [
            next(iter(s.device_set))
            if type(s) is SingleDeviceSharding and is_default_memory(s)
            else s
            for s in targets
        ]
    first = targets[0]
    if all(t is first for t in targets):
        targets = first  # likewise: one sharding is not broadcast over the tree
    out = jax.device_put(sources, targets, donate=donate, may_alias=may_alias)
    for i, leaf in zip(indices, out):
        leaves[i] = leaf
