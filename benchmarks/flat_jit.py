"""The flat sketch: the dispatch benchmark's peer for `equinox_shard.filter_jit`, a
filtered jit in about 35 lines as a careful user would write it by hand.

Per call: one `jax.tree.flatten` of `(args, kwargs)`; a mask of the array leaves
(`equinox.is_array`); a dict keyed on (treedef, mask, the non-array leaves) holding one
`jax.jit` over the flat list of array leaves, with the non-array leaves closed over;
`jax.tree.unflatten` on the way out. The output's non-array leaves come back through
`jax.jit`'s own output tree (a static pytree node, as in Equinox), so each trace brings
its own. The mask is memoised per tuple of leaf types: `equinox.is_array` depends on the
type alone, and each call is an `isinstance` against an ABC, about a microsecond a leaf,
which a careful user who measured would not pay on every call.

Why it is the peer: `jax.jit` on pre-partitioned leaves (the benchmark's `floor`) does
no filtering at all, and `equinox.filter_jit` does more than a filtered jit needs; this
is about the least that any filtered jit does per call, so what ours costs above it is
the price of its checks and its layering. It has no checks: a deleted or donated input,
a stale mesh, an unhashable non-array leaf are left to JAX (or fail).

`flat_jit(fun, lock, sharding)` gives `jax.jit` one sharding for every array input
and output (issue 48's peer for `in_shardings`), and launches each call under `lock`:
the sketch with the thread safety that `equinox_shard.filter_jit` gives a multi-device
call on the CPU (its `dispatch_lock`, RFC §6), so that the two can be compared at
equal safety. Without a lock the call path is unchanged.

`flat_step_jit` is the same sketch for a training step (`benchmarks/step.py`'s fed
step): one sharding per argument, and the first arguments' arrays donated.
"""

import dataclasses
from typing import Any

import equinox as eqx
import jax


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Out:
    """The output's treedef, mask and non-array leaves: a pytree without leaves."""

    treedef: Any
    mask: tuple
    static: tuple


_masks: dict = {}  # tuple of leaf types -> tuple of `eqx.is_array`


def _mask(leaves) -> tuple:
    types = tuple(map(type, leaves))
    mask = _masks.get(types)
    if mask is None:
        mask = _masks[types] = tuple(map(eqx.is_array, leaves))
    return mask


def flat_jit(fun, lock=None, sharding=None):
    # `sharding`: one `in_shardings` and `out_shardings` for every array leaf; inputs
    # go to `jax.jit` as they came (uncommitted and NumPy ones it moves itself).
    shardings = {} if sharding is None else dict(in_shardings=sharding)
    if sharding is not None:
        shardings["out_shardings"] = sharding
    cache = {}

    def build(treedef, mask, static):
        def flat(dynamic):
            it_d, it_s = iter(dynamic), iter(static)
            leaves = [next(it_d) if m else next(it_s) for m in mask]
            args, kwargs = jax.tree.unflatten(treedef, leaves)
            out_leaves, out_def = jax.tree.flatten(fun(*args, **kwargs))
            out_mask = _mask(out_leaves)
            out_static = tuple([x for x, m in zip(out_leaves, out_mask) if not m])
            out_dynamic = [x for x, m in zip(out_leaves, out_mask) if m]
            return out_dynamic, _Out(out_def, out_mask, out_static)

        jitted = jax.jit(flat, **shardings)
        if lock is None:
            return jitted
        held = lock

        def locked(dynamic):
            with held:
                return jitted(dynamic)

        return locked

    def call(*args, **kwargs):
        leaves, treedef = jax.tree.flatten((args, kwargs))
        mask = _mask(leaves)
        static = tuple([x for x, m in zip(leaves, mask) if not m])
        key = (treedef, mask, static)
        jitted = cache.get(key)
        if jitted is None:
            jitted = cache[key] = build(treedef, mask, static)
        out_dynamic, out = jitted([x for x, m in zip(leaves, mask) if m])
        it_d, it_s = iter(out_dynamic), iter(out.static)
        leaves = [next(it_d) if m else next(it_s) for m in out.mask]
        return jax.tree.unflatten(out.treedef, leaves)

    return call


def flat_step_jit(fun, in_shardings: tuple, out_sharding, donated: int):
    """The sketch for a training step (`benchmarks/step.py`): one sharding per
    positional argument, one for every output, and the array leaves of the first
    `donated` arguments donated (as one flat list, the others as another)."""
    cache = {}

    def build(args, treedef, mask, static):
        shardings = [s for a, s in zip(args, in_shardings) for _ in jax.tree.leaves(a)]
        n = len(jax.tree.leaves(args[:donated]))
        split = sum(mask[:n])
        arrays = [s for s, m in zip(shardings, mask) if m]

        def flat(donated_leaves, kept_leaves):
            it_d, it_s = iter([*donated_leaves, *kept_leaves]), iter(static)
            leaves = [next(it_d) if m else next(it_s) for m in mask]
            out_leaves, out_def = jax.tree.flatten(fun(*treedef.unflatten(leaves)))
            out_mask = _mask(out_leaves)
            out_static = tuple([x for x, m in zip(out_leaves, out_mask) if not m])
            out_dynamic = [x for x, m in zip(out_leaves, out_mask) if m]
            return out_dynamic, _Out(out_def, out_mask, out_static)

        jitted = jax.jit(
            flat,
            in_shardings=(arrays[:split], arrays[split:]),
            out_shardings=out_sharding,
            donate_argnums=0,
        )
        return jitted, split

    def call(*args):
        leaves, treedef = jax.tree.flatten(args)
        mask = _mask(leaves)
        static = tuple([x for x, m in zip(leaves, mask) if not m])
        key = (treedef, mask, static)
        entry = cache.get(key)
        if entry is None:
            entry = cache[key] = build(args, treedef, mask, static)
        jitted, split = entry
        dynamic = [x for x, m in zip(leaves, mask) if m]
        out_dynamic, out = jitted(dynamic[:split], dynamic[split:])
        it_d, it_s = iter(out_dynamic), iter(out.static)
        leaves = [next(it_d) if m else next(it_s) for m in out.mask]
        return jax.tree.unflatten(out.treedef, leaves)

    return call
