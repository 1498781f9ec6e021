"""The record of leaves that a checkpoint carries (see `_checkpoint.py`): what each
saved leaf is, under which name its array is stored, and a checksum of its values;
built by `build` on save, checked against `like` by `match` on restore before anything
else is read, and its checksums by `verify` once the arrays are read.

A checksum covers the values, not the layout, so a checkpoint restored onto any
sharding is checked the same way: for a JAX array (a PRNG key array: its key data) it is
the sum, modulo 2**32, of a 32-bit mix of each element's bits with its flat index,
computed on the devices that hold the array (one jitted pass, no gather); for a NumPy
array, the CRC-32 of its bytes.
"""

import zlib
from typing import Any

import jax
import jax._src.traceback_util as traceback_util
import jax.core
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from equinox import is_array

from ._donate import is_key_array, raise_if_deleted


traceback_util.register_exclusion(__file__)


FORMAT = "equinox_shard.checkpoint"
# 2: each array entry names its stored array ("name", `None` for a zero-size array,
# which is not stored) and carries its "checksum". Version 1 records are still read.
VERSION = 2
_SCALARS = (bool, int, float, complex)


def is_abstract(x: Any) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)


def kind(x: Any) -> str | None:
    """What is saved of a leaf: `array`, `key` (a typed PRNG key array), `numpy`,
    `scalar` (a Python bool/int/float/complex), or `None` (taken from `like`)."""
    if isinstance(x, jax.Array) or is_abstract(x):
        return "key" if is_key_array(x) else "array"
    if is_array(x):  # NumPy arrays and NumPy scalars
        return "numpy"
    if isinstance(x, _SCALARS):
        return "scalar"
    return None


def describe(entry: dict) -> str:
    if entry["kind"] == "scalar":
        return f"a Python {entry['type']} ({entry['value']!r})"
    what = {"array": "an array", "key": "a PRNG key array", "numpy": "a NumPy array"}
    return (
        f"{what[entry['kind']]} of shape {tuple(entry['shape'])} and dtype "
        + (entry["dtype"])
    )


def entry(kind: str, x: Any) -> dict:
    if kind == "scalar":
        value = [x.real, x.imag] if isinstance(x, complex) else x
        return {"kind": kind, "type": type(x).__name__, "value": value}
    return {"kind": kind, "shape": list(np.shape(x)), "dtype": str(x.dtype)}


#
# Checksums
#


def _fmix(h):
    # MurmurHash3's 32-bit finaliser: a bijection, so one changed element always
    # changes the sum.
    h = h ^ (h >> 16)
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _lanes(x):
    """Each element's bits as uint32 (a 64-bit element as two, along a new axis)."""
    dtype = x.dtype
    if dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return jnp.stack([_lanes(jnp.real(x)), _lanes(jnp.imag(x))], axis=-1)
    info = jnp.finfo(dtype) if jnp.issubdtype(dtype, jnp.floating) else jnp.iinfo(dtype)
    bits = info.bits
    if bits == 64:
        return lax.bitcast_convert_type(x, jnp.uint32)
    if bits in (8, 16, 32):
        unsigned = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32}[bits]
        return lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
    # 4- and 6-bit types: their values, exactly, in a 32-bit type.
    wide = jnp.float32 if jnp.issubdtype(dtype, jnp.floating) else jnp.int32
    return lax.bitcast_convert_type(x.astype(wide), jnp.uint32)


def _digest(x):
    lanes = _lanes(x)
    # Each element's flat index, without reshaping (which could move shards).
    index = jnp.zeros(lanes.shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(lanes.ndim)):
        iota = lax.broadcasted_iota(jnp.uint32, lanes.shape, axis)
        index = index + iota * np.uint32(stride % 2**32)
        stride *= lanes.shape[axis]
    mixed = _fmix(lanes ^ _fmix(index + np.uint32(0x9E3779B9)))
    return jnp.sum(mixed, dtype=jnp.uint32)


_digests = jax.jit(lambda xs: [_digest(x) for x in xs])


def checksums(arrays: list) -> list[int]:
    """The checksum of each JAX array (its key data for a PRNG key array), computed
    where it lies: one jitted pass per set of devices."""
    groups: dict[frozenset, list[int]] = {}
    for i, x in enumerate(arrays):
        groups.setdefault(frozenset(x.sharding.device_set), []).append(i)
    out = [0] * len(arrays)
    for indices in groups.values():
        data = [arrays[i] for i in indices]
        data = [jax.random.key_data(x) if is_key_array(x) else x for x in data]
        # An array in host memory (`jax.memory.Space.Host`) is read on its devices.
        data = [
            x if x.sharding.memory_kind in (None, "device") else _on_device(x)
            for x in data
        ]
        for i, d in zip(indices, _digests(data)):
            out[i] = int(np.asarray(d.addressable_data(0)))
    return out


def _on_device(x: jax.Array) -> jax.Array:
    return jax.device_put(x, x.sharding.with_memory_kind("device"))


def numpy_checksum(x: Any) -> int:
    return zlib.crc32(np.ascontiguousarray(x).tobytes())


#
# The record: built on save, matched against `like` on restore.
#


def build(tree: Any, name: str) -> tuple[dict, dict]:
    """The record of `tree`'s saved leaves and the arrays to store under their names.
    Raises (naming the leaf as `name<key path>`) before anything is written."""
    entries, arrays, jax_entries = [], {}, []
    for key_path, x in jtu.tree_flatten_with_path(tree)[0]:
        where = name + jtu.keystr(key_path)
        if isinstance(x, jax.core.Tracer) or is_abstract(x):
            raise ValueError(
                f"{where}: cannot save the abstract value {x!r}; `save` needs concrete "
                "arrays (call it outside `jax.jit`)."
            )
        k = kind(x)
        if k is None:
            continue
        raise_if_deleted(
            [x], (0,), lambda _: where, then=", so it cannot be saved", error=ValueError
        )
        e = entry(k, x)
        e["path"] = jtu.keystr(key_path)
        entries.append(e)
        if k == "scalar":
            continue
        if k == "key":
            e["impl"] = str(jax.random.key_impl(x))
        # orbax refuses a zero-size array; its record alone restores it.
        e["name"] = str(len(arrays)) if np.size(x) else None
        if e["name"] is None:
            continue
        if k == "numpy":
            arrays[e["name"]] = np.asarray(x)
            e["checksum"] = numpy_checksum(arrays[e["name"]])
        else:
            arrays[e["name"]] = jax.random.key_data(x) if k == "key" else x
            jax_entries.append(e)
    sums = checksums([arrays[e["name"]] for e in jax_entries])
    for e, s in zip(jax_entries, sums):
        e["checksum"] = s
    return {"format": FORMAT, "version": VERSION, "leaves": entries}, arrays


def names(entries: list[dict]) -> dict[str, str | None]:
    """Each array leaf's stored name (version 1: "0", "1", ... in record order)."""
    out, n = {}, 0
    for e in entries:
        if e["kind"] != "scalar":
            out[e["path"]] = e["name"] if "name" in e else str(n)
            n += 1
    return out


def match(path: Any, entries: list[dict], like: list) -> None:
    """Raises, naming the first leaf that differs, unless `like` (a list of
    `(key path, kind, leaf)`) has exactly the saved leaves' paths, kinds, shapes and
    dtypes."""
    saved = {e["path"]: e for e in entries}
    wanted = {p: (k, x) for p, k, x in like}
    for p, k, x in like:
        if p not in saved:
            raise ValueError(
                f"like{p}: `like` has {describe(entry(k, x))} here, but the "
                f"checkpoint at {path} has no saved leaf at this key path (its first "
                f"leaves: {', '.join(list(saved)[:5]) or 'none'})."
            )
        e = saved[p]
        mine = entry(k, x)
        if k == "numpy" and e["kind"] == "array":
            mine["kind"] = "array"  # a NumPy leaf of `like` may take a saved jax.Array
        if e["kind"] == "numpy" and k == "array":
            e = dict(e, kind="array")
        same = (
            e["kind"] == mine["kind"]
            and e.get("shape") == mine.get("shape")
            and e.get("dtype") == mine.get("dtype")
            and e.get("type") == mine.get("type")
        )
        if not same:
            raise ValueError(
                f"like{p}: the checkpoint at {path} has {describe(saved[p])} here, "
                f"but `like` has {describe(entry(k, x))}."
            )
    for p, e in saved.items():
        if p not in wanted:
            raise ValueError(
                f"like{p}: the checkpoint at {path} has {describe(e)} here, but "
                "`like` has no array or Python scalar at this key path."
            )


def verify(path: Any, entries: list[dict], stored: dict) -> None:
    """Raises, naming the leaf, where a restored array (`stored`: by name) does not
    have the checksum saved with it (by the algorithm of the kind it was saved as)."""
    checked = [e for e in entries if e.get("checksum") is not None]
    on_device = [e for e in checked if e["kind"] != "numpy"]
    values = [stored[e["name"]] for e in on_device]
    values = [x if isinstance(x, jax.Array) else jax.device_put(x) for x in values]
    got = dict(zip((e["name"] for e in on_device), checksums(values)))
    for e in checked:
        name = e["name"]
        read = got[name] if name in got else numpy_checksum(np.asarray(stored[name]))
        if read != e["checksum"]:
            raise ValueError(
                f"like{e['path']}: the checkpoint at {path} is damaged: the data read "
                f"for this leaf does not match the checksum saved with it (saved "
                f"{e['checksum']:#010x}, read {read:#010x})."
            )
