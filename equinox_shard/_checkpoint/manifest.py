"""The record of leaves a checkpoint carries: what each saved leaf is, its array's
stored name and checksum (docs/checkpoints.md, "Checksums"). `build` makes it on save;
`match` checks `like` against it before any array is read, `verify` the arrays read."""

import json
import math
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from equinox import is_array

from .._arrays import is_key_array, is_tracer, raise_if_deleted
from .orbax import writes


FORMAT = "equinox_shard.checkpoint"
# 2: each array entry has its stored "name" (`None`: zero-size) and "checksum".
# 3: the record has its own "checksum" (of everything else in it: the Python scalars);
# every later version keeps it as it is, so that a damaged "version" is found.
VERSION = 3
_SCALARS = (bool, int, float, complex)  # a subclass is saved as the first it is


def saved_form(x: Any) -> str | None:
    """What is saved of a leaf: `array`, `key` (a typed PRNG key array), `numpy`,
    `scalar` (a Python bool/int/float/complex), or `None` (taken from `like`)."""
    if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
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
    shape, dtype = tuple(entry["shape"]), entry["dtype"]
    return f"{what[entry['kind']]} of shape {shape} and dtype {dtype}"


def entry(form: str, x: Any) -> dict:
    if form == "scalar":
        base: Any = next(t for t in _SCALARS if isinstance(x, t))  # an IntEnum: int
        x = base(x)
        value = [x.real, x.imag] if isinstance(x, complex) else x
        return {"kind": form, "type": base.__name__, "value": value}
    return {"kind": form, "shape": list(np.shape(x)), "dtype": str(x.dtype)}


# Checksums (docs/checkpoints.md, "Checksums").
_CHUNK = 1 << 16  # elements per step on the host: NumPy's temporaries stay in cache


def _fmix(h):
    # MurmurHash3's finaliser: a bijection, so one changed element changes the sum.
    u = h.dtype.type  # uint32: a Python int this large would not fit JAX's int32
    h = (h ^ (h >> 16)) * u(0x85EBCA6B)
    h = (h ^ (h >> 13)) * u(0xC2B2AE35)
    return h ^ (h >> 16)


def _mixed_sum(xp, lanes, offset: int, starts, strides, iota):
    """The sum mod 2**32, by `xp`, of `fmix(fmix(0x9E3779B9 + i) ^ lane)` over `lanes`
    at flat indices `i = offset + sum((starts[a] + iota(a)) * strides[a])`."""
    index = xp.uint32((0x9E3779B9 + offset) % 2**32)
    for a, (start, stride) in enumerate(zip(starts, strides)):
        index = index + (iota(a) + xp.uint32(start % 2**32)) * xp.uint32(stride % 2**32)
    return xp.sum(_fmix(_fmix(index) ^ lanes), dtype=xp.uint32)


def _lanes(x: np.ndarray) -> np.ndarray:
    """Each element's bits as uint32 (a 64-bit element as two, along a new axis)."""
    if np.issubdtype(x.dtype, np.complexfloating):
        parts = [np.ascontiguousarray(np.real(x)), np.ascontiguousarray(np.imag(x))]
        return np.stack([_lanes(p) for p in parts], axis=-1)
    if x.dtype.itemsize == 8:
        return x.view(np.uint32).reshape(x.shape + (2,))
    if (bits := _bits(x.dtype)) is not None:  # a bool as its byte: 0 or 1
        return x.view(f"uint{bits}").astype(np.uint32, copy=False)
    # 4- and 6-bit types: their values, exactly, in a 32-bit type.
    wide = np.float32 if jnp.issubdtype(x.dtype, jnp.floating) else np.int32
    return x.astype(wide).view(np.uint32)


def _host_sum(data: np.ndarray, offset: int, starts: list, strides: list) -> int:
    """`_mixed_sum` over `data` (at `starts`), in pieces of at most `_CHUNK`."""
    if data.size <= _CHUNK:
        lanes = _lanes(data)
        shape = lambda a: [-1 if b == a else 1 for b in range(lanes.ndim)]
        iota = lambda a: np.arange(lanes.shape[a], dtype=np.uint32).reshape(shape(a))
        return int(_mixed_sum(np, lanes, offset, starts, strides, iota))
    if data.shape[0] == 1:  # the leading axis is folded into `offset`
        offset += starts[0] * strides[0]
        return _host_sum(data[0], offset, starts[1:], strides[1:])
    rows = max(1, _CHUNK // (data[0].size or 1))
    return sum(
        _host_sum(data[r : r + rows], offset, [starts[0] + r, *starts[1:]], strides)
        for r in range(0, data.shape[0], rows)
    )


def _partial_sum(data: np.ndarray, index: tuple, shape: tuple) -> int:
    """The checksum's sum over one shard (`data`, at `index`: slices of `shape`)."""
    if data.ndim == 0:
        data, index, shape = data.reshape(1), (slice(None),), (1,)
    extra = _lanes(np.zeros(1, data.dtype)).shape[1:]  # lanes per element
    full = tuple(shape) + extra
    strides = [math.prod(full[a + 1 :]) for a in range(len(full))]
    starts = [s.indices(n)[0] for s, n in zip(index, shape)] + [0] * len(extra)
    return _host_sum(data, 0, starts, strides) if data.size else 0


def _bits(dtype) -> int | None:
    """The width of an element of 8, 16 or 32 bits (one lane), else `None`."""
    if dtype == np.bool_:
        return 8
    if jnp.issubdtype(dtype, jnp.floating):
        bits = jnp.finfo(dtype).bits
    elif jnp.issubdtype(dtype, jnp.integer):
        bits = jnp.iinfo(dtype).bits
    else:
        return None
    whole = bits in (8, 16, 32) and bits == 8 * np.dtype(dtype).itemsize
    return bits if whole else None


# Where the device's memory is the host's: summed on the host (nothing compiled).
HOST_PLATFORMS = ("cpu",)


def on_device(x: Any) -> bool:
    """Whether `x` is summed on its devices: in an accelerator's memory, of a type
    `_bits` takes."""
    if not isinstance(x, jax.Array):
        return False
    if x.sharding.memory_kind not in (None, "device"):
        return False
    platforms = {d.platform for d in x.sharding.device_set}
    return platforms.isdisjoint(HOST_PLATFORMS) and _bits(x.dtype) is not None


def _device_sum(x: jax.Array) -> jax.Array:
    """The checksum of `x` as `_partial_sum` computes it, each device over its own."""
    if x.dtype == np.bool_:
        lanes = x.astype(jnp.uint32)
    else:
        unsigned = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32}[_bits(x.dtype) or 32]
        lanes = jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
    sharding = jax.typeof(lanes).sharding
    iota = lambda a: jax.lax.broadcasted_iota(
        jnp.uint32, lanes.shape, a, out_sharding=sharding
    )
    strides = [math.prod(x.shape[a + 1 :]) for a in range(x.ndim)]
    return _mixed_sum(jnp, lanes, 0, [0] * x.ndim, strides, iota)


_device_sums = jax.jit(lambda arrays: [_device_sum(x) for x in arrays])


def checksums(arrays: list) -> list[int]:
    """Each array's checksum: on its devices on an accelerator, else on the host."""
    arrays = [jax.random.key_data(x) if is_key_array(x) else x for x in arrays]
    out: list = [None] * len(arrays)  # the sums, `None` until computed
    # One call per set of devices: one over several would move arrays between them.
    groups: dict = {}
    for i, x in enumerate(arrays):
        if on_device(x):
            mesh = getattr(x.sharding, "mesh", None)
            devices = tuple(mesh.devices.flat) if mesh is not None else None
            if len(x.sharding.device_set) == 1:
                devices = tuple(x.sharding.device_set)
            groups.setdefault(devices or i, []).append(i)
    for group in groups.values():
        # Compiled even under `jax.disable_jit` (op by op it fails on an Explicit mesh).
        with jax.set_mesh(None), jax.disable_jit(False):
            sums = _device_sums([arrays[i] for i in group])
        # Each sum is on every device of the group, in every process: one copy here.
        sums = jax.device_get([s.addressable_data(0) for s in sums])
        for i, s in zip(group, sums):
            out[i] = int(s)
    spread = []
    for i, x in enumerate(arrays):
        if out[i] is not None:
            continue
        if isinstance(x, np.ndarray):
            out[i] = _partial_sum(x, (slice(None),) * x.ndim, x.shape)
            continue
        out[i] = sum(  # `jax.device_get`: explicit, so allowed by any transfer guard
            _partial_sum(jax.device_get(shard.data), shard.index, x.shape)
            for shard in x.addressable_shards
            if shard.replica_id == 0
        )
        if not x.is_fully_addressable:
            spread.append(i)
    if spread:
        from jax.experimental import multihost_utils

        with jax.set_mesh(None):
            sums = multihost_utils.process_allgather(
                np.asarray([out[i] % 2**32 for i in spread], np.uint32), tiled=False
            )
        for i, s in zip(spread, np.asarray(sums).astype(np.uint64).sum(axis=0)):
            out[i] = int(s)
    return [s % 2**32 for s in out]


def _stored_checksums(entries: list[dict], stored: dict) -> list[int]:
    """The checksum of each entry's array in `stored` (a NumPy array's: its CRC-32)."""
    jax_entries = [e for e in entries if e["kind"] != "numpy"]
    sums = checksums([stored[e["name"]] for e in jax_entries])
    sums = dict(zip((e["name"] for e in jax_entries), sums))
    crc32 = lambda x: zlib.crc32(np.ascontiguousarray(x).tobytes())
    return [
        sums[e["name"]] if e["name"] in sums else crc32(stored[e["name"]])
        for e in entries
    ]


def build(tree: Any, name: str) -> tuple[dict, dict]:
    """The record of `tree`'s saved leaves, and the arrays to store by name; errors
    name the leaf as `name<key path>`."""
    entries, arrays = [], {}
    for key_path, x in jtu.tree_flatten_with_path(tree)[0]:
        where = name + jtu.keystr(key_path)
        if is_tracer(x) or isinstance(x, jax.ShapeDtypeStruct):
            raise ValueError(
                f"{where}: cannot save the abstract value {x!r}; `save` needs concrete "
                "arrays (call it outside `jax.jit`)."
            )
        k = saved_form(x)
        if k is None:
            continue
        raise_if_deleted([x], (0,), lambda _: where, then=", so it cannot be saved")
        e = entry(k, x)
        e["path"] = jtu.keystr(key_path)
        entries.append(e)
        if k == "scalar":
            continue
        if k == "key":
            e["impl"] = str(jax.random.key_impl(x))
            x = jax.random.key_data(x)
        # orbax refuses a zero-size array; its record alone restores it.
        e["name"] = str(len(arrays)) if np.size(x) else None
        if e["name"] is not None and not writes(np.dtype(x.dtype)):
            raise ValueError(
                f"{where}: orbax-checkpoint cannot write an array of dtype {x.dtype} "
                "(TensorStore has no such data type). Convert it to one it stores, or "
                "leave it out of the saved tree."
            )
        if e["name"] is not None:
            arrays[e["name"]] = np.asarray(x) if k == "numpy" else x
    stored = [e for e in entries if e.get("name") is not None]
    for e, s in zip(stored, _stored_checksums(stored, arrays)):
        e["checksum"] = s
    record = {"format": FORMAT, "version": VERSION, "leaves": entries}
    return {**record, "checksum": _record_checksum(record)}, arrays


def _record_checksum(record: dict) -> int:
    """The CRC-32 of the record (but its own "checksum") as canonical JSON."""
    rest = {k: v for k, v in record.items() if k != "checksum"}
    return zlib.crc32(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode())


def unsealed(record: dict) -> str | None:
    """Why the record read back does not match its checksum, or `None` (it does, or
    it is of version 1 or 2, which have none)."""
    if "checksum" not in record:
        old = record.get("version") in (1, 2)
        return None if old else "has no checksum of its own"
    if record["checksum"] != _record_checksum(record):
        return "does not match the checksum saved in it"
    return None


def json_type(x: Any) -> str:
    """The type of `x`, as `json.loads` returned it, for an error."""
    return "null" if x is None else f"a JSON {type(x).__name__}"


def _dtype(x: Any) -> bool:
    try:
        return isinstance(x, str) and np.dtype(x) is not None
    except TypeError:
        return False


_int = lambda x: isinstance(x, int) and not isinstance(x, bool)
_float = lambda x: isinstance(x, float) or _int(x)
_str = lambda x: isinstance(x, str)
_FITS = {  # a scalar entry's "type" -> whether its "value" is one
    "bool": lambda v: isinstance(v, bool),
    "int": _int,
    "float": _float,
    "complex": lambda v: isinstance(v, list) and len(v) == 2 and all(map(_float, v)),
}


def _entry_problem(e: Any, version: int) -> str | None:
    if not isinstance(e, dict):
        return f"it is {json_type(e)}, not a JSON object"
    k, t = e.get("kind"), e.get("type")
    # (field, whether it must be there, its test, what it must be)
    fields = [
        ("path", True, _str, "a string"),
        ("kind", True, ("array", "key", "numpy", "scalar").__contains__,
         "one of 'array', 'key', 'numpy', 'scalar'"),
    ]  # fmt: skip
    if k == "scalar":
        fits = _FITS.get(t) if isinstance(t, str) else None
        fields += [
            ("type", True, lambda t: fits is not None, "one of " + ", ".join(_FITS)),
            ("value", True, fits or _str, f"a Python {t}"),
        ]
    else:
        u32 = lambda c: c is None or (_int(c) and 0 <= c < 2**32)
        shape = lambda s: isinstance(s, list) and all(_int(n) and n >= 0 for n in s)
        fields += [
            ("shape", True, shape, "an array of non-negative integers"),
            ("dtype", True, _str if k == "key" else _dtype, "a dtype"),
            ("impl", k == "key", _str, "a string"),
            ("name", version >= 2, lambda n: n is None or _str(n), "a string or null"),
            ("checksum", version >= 2 and e.get("name") is not None, u32,
             "an unsigned 32-bit integer"),
        ]  # fmt: skip
    for field, required, test, what in fields:
        if field not in e and required:
            return f"it has no {field!r}"
        if field in e and not test(e[field]):
            return f"its {field!r} is {e[field]!r}, not {what}"
    return None


def problem(record: Any) -> str | None:
    """What is wrong with a record read back, or `None` (a newer version: unchecked)."""
    for field in ("format", "version", "leaves"):
        if field not in record:
            return f"it has no {field!r}"
    version = record["version"]
    if not _int(version) or version < 1:
        return f"its 'version' {version!r} is not a positive integer"
    if version > VERSION:
        return None
    if not isinstance(record["leaves"], list):
        return f"its 'leaves' is {json_type(record['leaves'])}, not a JSON list"
    for i, e in enumerate(record["leaves"]):
        if (why := _entry_problem(e, version)) is not None:
            where = e.get("path") if isinstance(e, dict) else None
            leaf = f" (of the leaf {where})" if isinstance(where, str) else ""
            return f"its leaf entry {i}{leaf}: {why}"
    return None


def names(entries: list[dict]) -> dict[str, str | None]:
    """Each array leaf's stored name (version 1: "0", "1", ... in record order)."""
    out, n = {}, 0
    for e in entries:
        if e["kind"] != "scalar":
            out[e["path"]] = e["name"] if "name" in e else str(n)
            n += 1
    return out


def match(path: Any, entries: list[dict], like: list) -> None:
    """Raises, naming the first leaf that differs, unless `like`'s `(key path, saved
    form, leaf)`s have exactly the saved leaves' paths, forms, shapes and dtypes."""
    saved = {e["path"]: e for e in entries}
    for p, k, x in like:
        if p not in saved:
            raise ValueError(
                f"like{p}: `like` has {describe(entry(k, x))} here, but the "
                f"checkpoint at {path} has no saved leaf at this key path (its first "
                f"leaves: {', '.join(list(saved)[:5]) or 'none'})."
            )
        e, mine = saved[p], entry(k, x)
        # A NumPy leaf of `like` may take a saved jax.Array, and the other way round.
        kinds = {e["kind"], mine["kind"]}
        same = len(kinds) == 1 or kinds == {"numpy", "array"}
        if not same or any(e.get(f) != mine.get(f) for f in ("shape", "dtype", "type")):
            raise ValueError(
                f"like{p}: the checkpoint at {path} has {describe(e)} here, "
                f"but `like` has {describe(mine)}."
            )
    wanted = {p for p, _, _ in like}
    for p, e in saved.items():
        if p not in wanted:
            raise ValueError(
                f"like{p}: the checkpoint at {path} has {describe(e)} here, but "
                "`like` has no array or Python scalar at this key path."
            )


def verify(path: Any, entries: list[dict], stored: dict) -> None:
    """Raises, naming the leaf, where an array read does not have its saved checksum."""
    checked = [e for e in entries if e.get("checksum") is not None]
    for e, read in zip(checked, _stored_checksums(checked, stored)):
        if read != e["checksum"]:
            raise ValueError(
                f"like{e['path']}: the checkpoint at {path} is damaged: the data read "
                f"for this leaf does not match the checksum saved with it (saved "
                f"{e['checksum']:#010x}, read {read:#010x})."
            )
