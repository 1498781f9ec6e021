"""The filtered `jax.make_array_from_process_local_data`."""

from typing import Any

import jax
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree

from ._arrays import is_committed
from ._multihost import check_identical, is_host_local, processes_of, to_host
from ._placement import place
from ._spec.language import broadcast_prefix, check, leaf_path, resolve_leaves


def _is_shape(x: Any) -> bool:
    return x is None or (isinstance(x, tuple) and all(isinstance(d, int) for d in x))


def _broadcast_shapes(global_shape: Any, local_data: Any, n: int) -> list:
    if _is_shape(global_shape):
        return [global_shape] * n
    shape_leaves, shape_def = jtu.tree_flatten(global_shape, is_leaf=_is_shape)
    must = (
        "`global_shape` must be None, a shape (a tuple of ints), or a PyTree prefix of "
        "`local_data` whose leaves are those"
    )
    for leaf in shape_leaves:
        if not _is_shape(leaf):
            raise TypeError(f"{must}; got a leaf {leaf!r}.")
    try:
        return broadcast_prefix(shape_leaves, shape_def, local_data)
    except (ValueError, TypeError):
        structure = jtu.tree_structure(local_data)
        raise ValueError(
            f"{must}; got {global_shape!r} for a `local_data` of structure {structure}."
        ) from None


def filter_make_array_from_process_local_data(
    shardings: Any,
    local_data: PyTree[Any],
    global_shape: Any = None,
) -> PyTree[Any]:
    """Filtered version of `jax.make_array_from_process_local_data`: builds global
    arrays (spanning several processes) from the part of each array that this process
    holds, e.g. its share of a batch, laid out as JAX lays it out (an example is in
    docs/multiprocess.md). Values that every process holds whole (a model's parameters)
    are placed with [`equinox_shard.filter_device_put`][] instead.

    **Arguments:**

    - `shardings`: a PyTree prefix of `local_data`, in the specification language of
        [`equinox_shard.filter_device_put`][] (a callable sees the *local* array).
    - `local_data`: any PyTree. Its array leaves (`equinox.is_array`: NumPy arrays,
        `jax.Array`s on this process's devices, typed PRNG keys) are this process's
        parts.
    - `global_shape`: `None` (the default) infers each global shape from the local
        shape and the sharding, as JAX does; else a shape (a tuple of ints) for every
        array, or a PyTree prefix of `local_data` of shapes and `None`s.

    **Returns:**

    A PyTree like `local_data`: each array leaf with a specification becomes a global
    `jax.Array` with its sharding; other leaves, and a global array that already has
    its sharding, are the same objects. In one process this is `filter_device_put`
    (and `global_shape` must be `None` or the local shape).

    **Raises:**

    A `ValueError` naming the key path (`local_data['x']`) for a specification that is
    not a prefix, a rank or divisibility mismatch, a local shape that is neither the
    global shape nor this process's share of it, a sharding with no device in this
    process, or an array that every process holds whole (its global shape is its local
    shape, its sharding spans every process) with different values, found by one small
    collective of fingerprints.
    """
    leaves, treedef = jtu.tree_flatten(local_data)
    todo = resolve_leaves(
        local_data, leaves, shardings, "shardings", "local_data", abstract_ok=False
    )
    if not todo:
        return local_data
    shapes = _broadcast_shapes(global_shape, local_data, len(leaves))
    path = lambda i: leaf_path(local_data, i, "local_data")
    if jax.process_count() == 1:
        for i, _ in todo:
            if shapes[i] not in (None, np.shape(leaves[i])):
                raise ValueError(
                    f"{path(i)}: in a single-process run, `global_shape` must be None "
                    f"or the local shape {np.shape(leaves[i])}; got {shapes[i]}."
                )
        place(leaves, todo, path)
        return jtu.tree_unflatten(treedef, leaves)
    me = jax.process_index()
    everyone = frozenset(range(jax.process_count()))
    checked = []
    for i, sharding in todo:
        where = lambda i=i: path(i)
        leaf = leaves[i]
        if not is_host_local(leaf):
            if is_committed(leaf) and leaf.sharding.is_equivalent_to(
                sharding, leaf.ndim
            ):
                continue  # Already this global array: the same object.
            raise ValueError(
                f"{where()}: expected this process's part of the array, as a NumPy "
                "array or a `jax.Array` on this process's devices; got an array "
                "spanning devices of other processes. Use "
                "`equinox_shard.filter_device_put` to reshard a global array."
            )
        processes = processes_of(sharding)
        if me not in processes:
            raise ValueError(
                f"{where()}: the sharding {sharding} has no device in this process "
                f"(process {me}; its devices belong to processes "
                f"{sorted(processes)}), so this process has no part of the array to "
                "give. Use a sharding whose mesh includes every calling process's "
                "devices."
            )
        if len(getattr(sharding, "spec", ())) > np.ndim(leaf):
            check(np.shape(leaf), sharding, where)  # Raises the rank error.
        data, impl = to_host(leaf, where)
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
