"""Building global arrays from the part of each array that this process holds (the
filtered `jax.make_array_from_process_local_data`)."""

from typing import Any

import jax
import jax._src.traceback_util as traceback_util
import jax.tree_util as jtu
import numpy as np
from jax.sharding import NamedSharding
from jaxtyping import PyTree

from ._multihost import check_identical, is_host_local, processes_of, to_host
from ._placement import place
from ._spec.language import broadcast_prefix, check, leaf_path, resolve_leaves


traceback_util.register_exclusion(__file__)


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
        return broadcast_prefix(shape_leaves, shape_def, local_data)
    except (ValueError, TypeError):
        raise ValueError(
            "`global_shape` must be None, a shape (a tuple of ints), or a PyTree "
            f"prefix of `local_data`; got {global_shape!r} for a `local_data` of "
            f"structure {jtu.tree_structure(local_data)}."
        ) from None


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
    todo = resolve_leaves(
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
        place(leaves, todo, lambda i: leaf_path(local_data, i, "local_data"))
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
        processes = processes_of(sharding)
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
