"""Which buffers `jax.device_put` hands back whatever `may_alias` says (RFC §6)."""

from typing import Any

import jax
from jax.sharding import Sharding

from ._arrays import is_concrete


def private_copies(leaves: list, indices: list[int]) -> None:
    """Replaces each `leaves[i]`, `i` in `indices`, by a copy sharing no buffer."""
    if not indices:
        return
    copies = jax.device_put(
        [leaves[i] for i in indices],
        [leaves[i].sharding for i in indices],
        may_alias=False,
    )
    for i, x in zip(indices, copies):
        leaves[i] = x


def shares_single_device_buffer(sharding: Sharding) -> bool:
    """Whether `jax.device_put(x, sharding, may_alias=False)` keeps the buffer of an `x`
    on one of `sharding`'s devices alone: onto several devices, replicated."""
    return len(sharding.device_set) > 1 and sharding.is_fully_replicated


def shares_source_buffer(leaf: Any, sharding: Sharding) -> bool:
    """Whether `jax.device_put(leaf, sharding, may_alias=False)` may keep a buffer of
    `leaf`: one whose shard stays on its device (RFC §6's table)."""
    if not isinstance(leaf, jax.Array):
        return False
    source = leaf.sharding
    if source.device_set.isdisjoint(sharding.device_set):
        return False
    if len(source.device_set) == 1:
        # Onto its own device alone, JAX does copy.
        return shares_single_device_buffer(sharding)
    source_map = source.devices_indices_map(leaf.shape)
    return any(
        source_map.get(device) == index
        for device, index in sharding.devices_indices_map(leaf.shape).items()
    )


def jit_frees(leaf: Any, sharding: Sharding) -> bool:
    """Whether `jax.jit` frees `leaf`, donated, when it moves it onto `sharding`: where
    one of the two uses only buffers of the other (same device, same index)."""
    if not is_concrete(leaf):
        return False
    source = leaf.sharding.devices_indices_map(leaf.shape)
    target = sharding.devices_indices_map(leaf.shape)
    within = lambda a, b: all(b.get(device) == index for device, index in a.items())
    return within(source, target) or within(target, source)
