"""The PyTrees and layouts that the benchmarks run on.

A tree of `n` array leaves comes in two kinds, both with about one non-array leaf per
three arrays:

- `"module"`: an `eqx.Module` holding a tuple of `Block`s, each with up to three arrays
    and one non-array field (a string, as an activation's name would be);
- `"list"`: a flat Python list, with a non-array leaf (a Python float) after every
    third array.

Every array has shape `(8, 4)` and dtype float32, so that it can be split along its
first axis over 8 devices.
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.sharding import (
    AxisType,
    make_single_device_sharding,
    NamedSharding,
    PartitionSpec,
)


SHAPE = (8, 4)
TREES = ("module", "list")
LAYOUTS = ("replicated", "batch", "single")


class Block(eqx.Module):
    a: jax.Array | None
    b: jax.Array | None
    c: jax.Array | None
    kind: str


class Tree(eqx.Module):
    blocks: tuple[Block, ...]


def n_static(n: int) -> int:
    return math.ceil(n / 3)


def _values(n: int, seed: int) -> list:
    base = np.arange(math.prod(SHAPE), dtype=np.float32).reshape(SHAPE)
    return [jnp.asarray(base + (seed + i)) for i in range(n)]


def make_tree(kind: str, n: int, seed: int = 0, fresh_static: bool = False):
    """A tree of `n` uncommitted array leaves (on the default device).

    With `fresh_static=True` the non-array leaves are new objects, equal to (but not
    the same as) those of every other call."""
    arrays = _values(n, seed)
    tag = lambda i: "".join(["re", "lu"]) if fresh_static else "relu"
    if kind == "module":
        blocks = []
        for start in range(0, n, 3):
            chunk = arrays[start : start + 3]
            chunk = chunk + [None] * (3 - len(chunk))
            blocks.append(Block(*chunk, kind=tag(start)))  # pyright: ignore
        return Tree(tuple(blocks))
    if kind == "list":
        out = []
        for i, x in enumerate(arrays):
            out.append(x)
            if i % 3 == 2 or i == n - 1:
                out.append(0.5 if not fresh_static else float("0.5"))
        return out
    raise ValueError(kind)


def mesh():
    return jax.make_mesh((len(jax.devices()),), ("data",), axis_types=(AxisType.Auto,))


def sharding(layout: str):
    if layout == "replicated":
        return NamedSharding(mesh(), PartitionSpec())
    if layout == "batch":
        return NamedSharding(mesh(), PartitionSpec("data"))
    if layout == "single":
        return make_single_device_sharding(jax.devices()[0])
    raise ValueError(layout)


def place(tree, s):
    """Commits every array leaf of `tree` to `s` (one batched `jax.device_put`)."""
    dynamic, static = eqx.partition(tree, eqx.is_array)
    return eqx.combine(jax.block_until_ready(jax.device_put(dynamic, s)), static)


def add_one(tree):
    """The trivial body: add one to every array leaf, return the rest as it is."""
    return jtu.tree_map(lambda x: x + 1 if eqx.is_array(x) else x, tree)


def array_leaves(tree) -> list:
    return [x for x in jtu.tree_leaves(tree) if eqx.is_array(x)]


def static_leaves(tree) -> list:
    return [x for x in jtu.tree_leaves(tree) if not eqx.is_array(x)]


def identity_fraction(before, after) -> float:
    """The fraction of the array leaves of `after` that are those of `before`."""
    xs, ys = array_leaves(before), array_leaves(after)
    assert len(xs) == len(ys)
    return sum(x is y for x, y in zip(xs, ys)) / max(len(xs), 1)


def static_identity_fraction(before, after) -> float:
    xs, ys = static_leaves(before), static_leaves(after)
    assert len(xs) == len(ys)
    return sum(x is y for x, y in zip(xs, ys)) / max(len(xs), 1)
