"""What an array (concrete, committed, deleted, ...) or a sharding is, defined once."""

from collections.abc import Callable
from itertools import compress, repeat
from typing import Any

import jax
import jax.core
import numpy as np
from equinox import is_array


# The memory kinds that mean a device's default memory (`None`: unspecified).
DEFAULT_MEMORY = (None, "device")

# `isinstance(x, Tracer)` in C: `any(map(is_tracer, leaves))` runs no Python frame.
is_tracer = jax.core.Tracer.__instancecheck__

# The NumPy values that JAX places as arrays.
NUMPY = (np.ndarray, np.generic)
# Unequal for distinct objects (equal ones are told apart by `id`); unlike `id`, raises
# no audit event, which runs filelock's Python hook on Python >= 3.12 (JAX imports it).
identity_hash = object.__hash__


def in_default_memory(sharding: Any) -> bool:
    """Whether `sharding` places its arrays in the devices' default memory."""
    return sharding.memory_kind in DEFAULT_MEMORY


# JAX 0.12.1 deprecates naming `SingleDeviceSharding` and adds this predicate.
is_single_device_sharding: Callable[[Any], bool] = getattr(
    jax.sharding,
    "is_single_device_sharding",
    lambda sharding: isinstance(sharding, jax.sharding.SingleDeviceSharding),
)


def on_abstract_mesh(sharding: Any) -> bool:
    """Whether `sharding` is on an `AbstractMesh` (resolved inside a trace)."""
    return isinstance(getattr(sharding, "mesh", None), jax.sharding.AbstractMesh)


def is_array_or_struct(x: Any) -> bool:
    """Whether `x` is an array (`equinox.is_array`) or a `jax.ShapeDtypeStruct`."""
    return is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def is_concrete(x: Any) -> bool:
    """Whether `x` is a `jax.Array` with buffers (perhaps deleted), not a tracer."""
    return isinstance(x, jax.Array) and not is_tracer(x)


def is_committed(x: Any) -> bool:
    """Whether `x` is a concrete `jax.Array` committed to its sharding."""
    return is_concrete(x) and x.committed  # pyright: ignore[reportAttributeAccessIssue]


def is_value(x: Any) -> bool:
    """Whether `x` is a NumPy array or scalar, or a concrete `jax.Array`."""
    return isinstance(x, NUMPY) or is_concrete(x)


def is_key_array(x: Any) -> bool:
    """Whether `x` (an array or a `jax.ShapeDtypeStruct`) holds typed PRNG keys."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.numpy.issubdtype(dtype, jax.dtypes.prng_key)


def is_deleted(x: Any) -> bool:
    """Whether `x` is a concrete `jax.Array` whose buffers are gone (e.g. donated)."""
    return is_concrete(x) and x.is_deleted()  # pyright: ignore[reportAttributeAccessIssue]


def raise_if_deleted(
    leaves,
    indices,
    where: Callable[[int], str],
    what: str = "this array",
    then: str = "",
) -> None:
    """Raises the `RuntimeError` for the first deleted `leaves[i]`, at `where(i)`."""
    for i in indices:
        if is_deleted(leaves[i]):
            raise RuntimeError(  # said once, not after JAX's or a launch's error
                f"{where(i)}: {what} has been deleted (was it donated to an earlier "
                f"call?){then}."
            ) from None


def raise_if_not_jax_type(leaves, indices, where: Callable[[int], str]) -> None:
    """Raises JAX's `TypeError` for a NumPy `leaves[i]` of no JAX type at `where(i)`."""
    for i in indices:
        try:
            isinstance(leaves[i], NUMPY) and jax.typeof(leaves[i])
        except TypeError as error:
            raise TypeError(f"{where(i)}: {error}") from None


def raise_if_fun_deleted(fun_name: str, dynamic_fun: Any) -> None:
    """As `raise_if_deleted`, for the arrays of the function being JIT'd."""
    flat = jax.tree_util.tree_flatten_with_path(dynamic_fun)[0]
    where = lambda i: fun_name + jax.tree_util.keystr(flat[i][0])
    what = "this array of the function being JIT'd"
    raise_if_deleted([x for _, x in flat], range(len(flat)), where, what)


def deleted_test(leaves: list, get: Callable[[list], tuple]) -> Callable[[list], bool]:
    """A fast `leaves -> bool`: whether any of `get(leaves)` is deleted, mapping one
    array type's own `is_deleted` in C past the leaves still NumPy's (never deleted)."""

    def slow(leaves):
        return any(map(is_deleted, get(leaves)))

    values = get(leaves)
    numpy = tuple(isinstance(x, NUMPY) for x in values)
    arrays = tuple(not n for n in numpy)
    types = set(map(type, compress(values, arrays)))
    if len(types) > 1:
        return slow
    type_is_deleted: Any = None
    if types:
        (array_type,) = types
        if not issubclass(array_type, jax.Array) or issubclass(
            array_type, jax.core.Tracer
        ):
            return slow
        type_is_deleted = array_type.is_deleted

    def fast(leaves):
        values = get(leaves)
        try:
            if any(map(type_is_deleted, compress(values, arrays))):
                return True
        except (TypeError, AttributeError):  # a `Compiled` called with other types
            return slow(leaves)
        if all(map(isinstance, compress(values, numpy), _NUMPY)):
            return False  # still NumPy where it was
        return slow(leaves)

    return fast


_NUMPY = repeat(NUMPY)
