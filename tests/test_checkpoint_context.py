"""`save`, `restore` and `CheckpointManager` under whatever the caller has set (a mesh
with Auto or Explicit axes, a default device, x64, strict promotion, rank promotion
raising, NaN checks, a transfer guard): the same checkpoint and the same restored
values as outside it."""

import contextlib

import equinox_shard as eqxs
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from .helpers import (
    assert_same_values,
    auto_mesh,
    explicit_mesh,
    grid_shape,
    nth_device,
    snapshot,
)


pytest.importorskip("orbax.checkpoint")

CONTEXTS = {
    "auto_mesh": lambda: jax.set_mesh(auto_mesh(grid_shape(), ("data", "model"))),
    "explicit_mesh": lambda: jax.set_mesh(
        explicit_mesh(grid_shape(), ("data", "model"))
    ),
    "default_device": lambda: jax.default_device(nth_device(5)),
    "x64": lambda: jax.enable_x64(True),
    "strict_promotion": lambda: jax.numpy_dtype_promotion("strict"),
    "rank_promotion_raise": lambda: jax.numpy_rank_promotion("raise"),
    "debug_nans": lambda: jax.debug_nans(True),
    "transfer_guard": lambda: jax.transfer_guard("disallow"),
}


def _state():
    # A leaf on one device (device 3), one split over a mesh of its own, a typed key
    # on one device, a NumPy array and a Python scalar.
    mesh = auto_mesh(names=("x",))
    return {
        "one": jax.device_put(jnp.arange(6.0).reshape(2, 3), nth_device(3)),
        "split": jax.device_put(
            jnp.arange(32, dtype=jnp.int32).reshape(8, 4), NamedSharding(mesh, P("x"))
        ),
        "key": jax.device_put(jax.random.key(7), nth_device(3)),
        "host": np.linspace(0.0, 1.0, 5, dtype=np.float32),
        "n": 3,
    }


def _context(name):
    return CONTEXTS[name]()


@pytest.mark.parametrize("name", list(CONTEXTS))
def test_save_and_restore_under_context(tmp_path, name):
    state = _state()
    expected = snapshot(state)
    eqxs.save(tmp_path / "outside", state)
    with _context(name):
        eqxs.save(tmp_path / "inside", state)
        out = eqxs.restore(tmp_path / "outside", state)
    assert_same_values(out, expected)
    assert out["one"].sharding == state["one"].sharding
    assert out["split"].sharding == state["split"].sharding
    # Written under the context, read outside it: the same values, and the same
    # record of leaves (checksums included).
    assert_same_values(eqxs.restore(tmp_path / "inside", state), expected)
    record = (tmp_path / "inside" / "leaves" / "metadata").read_text()
    assert record == (tmp_path / "outside" / "leaves" / "metadata").read_text()
    assert_same_values(state, expected)  # nothing changed


@pytest.mark.parametrize("name", list(CONTEXTS))
def test_manager_under_context(tmp_path, name):
    state = _state()
    expected = snapshot(state)
    with eqxs.CheckpointManager(tmp_path / "outside") as manager:
        manager.save(1, state)
    with contextlib.ExitStack() as stack:
        stack.enter_context(_context(name))
        manager = stack.enter_context(eqxs.CheckpointManager(tmp_path / "inside"))
        assert manager.save(1, state)
        assert manager.latest_step() == 1
        out = manager.restore(state)
        assert manager.all_steps() == [1]
    assert_same_values(out, expected)
    assert out["one"].sharding == state["one"].sharding
    with eqxs.CheckpointManager(tmp_path / "inside") as manager:
        assert_same_values(manager.restore(state), expected)
    record = (tmp_path / "inside" / "1" / "leaves" / "metadata").read_text()
    assert record == (tmp_path / "outside" / "1" / "leaves" / "metadata").read_text()


def _reference_checksum(x):
    # The checksum as version 2 of the record defines it, written with jax.numpy and
    # run on the array's devices (as `save` computed it before it moved to the host).
    def fmix(h):
        h = h ^ (h >> 16)
        h = h * np.uint32(0x85EBCA6B)
        h = h ^ (h >> 13)
        h = h * np.uint32(0xC2B2AE35)
        return h ^ (h >> 16)

    def lanes(x):
        if x.dtype == jnp.bool_:
            return x.astype(jnp.uint32)
        if jnp.issubdtype(x.dtype, jnp.complexfloating):
            return jnp.stack([lanes(jnp.real(x)), lanes(jnp.imag(x))], axis=-1)
        floating = jnp.issubdtype(x.dtype, jnp.floating)
        bits = (jnp.finfo if floating else jnp.iinfo)(x.dtype).bits
        if bits == 64:
            return jax.lax.bitcast_convert_type(x, jnp.uint32)
        if bits in (8, 16, 32):
            unsigned = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32}[bits]
            return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
        wide = jnp.float32 if floating else jnp.int32
        return jax.lax.bitcast_convert_type(x.astype(wide), jnp.uint32)

    def digest(x):
        bits = lanes(x)
        index, stride = jnp.zeros(bits.shape, jnp.uint32), 1
        for axis in reversed(range(bits.ndim)):
            iota = jax.lax.broadcasted_iota(jnp.uint32, bits.shape, axis)
            index = index + iota * np.uint32(stride % 2**32)
            stride *= bits.shape[axis]
        mixed = fmix(bits ^ fmix(index + np.uint32(0x9E3779B9)))
        return jnp.sum(mixed, dtype=jnp.uint32)

    return int(jax.jit(digest)(x))


@pytest.mark.parametrize(
    "dtype, shape, spec",
    [
        (jnp.float32, (16, 6), P("data", "model")),
        (jnp.float32, (6, 16), P(None, ("data", "model"))),
        (jnp.bfloat16, (8, 4, 6), P("model", "data")),
        (jnp.int4, (8, 6), P("data")),
        (jnp.bool_, (8,), P("data")),
        (jnp.uint8, (), P()),
        (jnp.complex64, (4, 2, 3, 2), P(None, "model")),
        (jnp.float8_e4m3fn, (16, 6), P("data")),
    ],
)
def test_checksums_are_those_of_version_2(dtype, shape, spec):
    # Computed on the host, shard by shard (in pieces smaller than a shard's rows, to
    # cross their boundaries): the very sums that checkpoints already written carry.
    from equinox_shard._checkpoint import manifest

    mesh = auto_mesh(grid_shape(), ("data", "model"))
    values = np.random.default_rng(0).standard_normal(shape) * 5
    x = jax.device_put(jnp.asarray(values).astype(dtype), NamedSharding(mesh, spec))
    expected = _reference_checksum(x)
    assert manifest.checksums([x]) == [expected]
    chunk, manifest._CHUNK = manifest._CHUNK, 5
    try:
        assert manifest.checksums([x]) == [expected]
    finally:
        manifest._CHUNK = chunk


@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
def test_checksums_on_the_device_are_those_of_the_host(monkeypatch, axis_type):
    # On an accelerator each checksum is computed on the array's devices (no copy to
    # the host); here the CPU stands in for one. The very sums of the host pass, for
    # every type the device pass takes, any sharding, under the caller's mesh.
    from equinox_shard._checkpoint import manifest

    mesh = {"auto": auto_mesh, "explicit": explicit_mesh}[axis_type](
        grid_shape(), ("data", "model")
    )
    rng = np.random.default_rng(0)
    cases = [
        (jnp.float32, (16, 6), P("data", "model")),
        (jnp.float32, (6, 16), P(None, ("data", "model"))),
        (jnp.bfloat16, (8, 4, 6), P("model", "data")),
        (jnp.bool_, (8,), P("data")),
        (jnp.uint8, (), P()),
        (jnp.int16, (3, 5), P()),
        (jnp.float8_e4m3fn, (16, 6), P("data")),
        (jnp.int4, (8, 6), P("data")),  # not taken: summed on the host
    ]
    arrays = [
        jax.device_put(
            jnp.asarray(rng.standard_normal(shape) * 5).astype(dtype),
            NamedSharding(mesh, spec),
        )
        for dtype, shape, spec in cases
    ]
    arrays.append(jax.device_put(jax.random.key(3), NamedSharding(mesh, P())))
    # The same devices in another mesh, and one device: several calls, no transfer.
    other = explicit_mesh(names=("x",))
    arrays.insert(0, jax.device_put(jnp.arange(16.0), NamedSharding(other, P("x"))))
    arrays.insert(0, jax.device_put(jnp.arange(3, dtype=jnp.int8), nth_device(5)))
    # Every array summed on the host first, whatever the devices' platform.
    platforms = tuple({d.platform for x in arrays for d in x.sharding.device_set})
    monkeypatch.setattr(manifest, "HOST_PLATFORMS", platforms)
    host = manifest.checksums(arrays)
    assert not any(manifest.on_device(x) for x in arrays)
    monkeypatch.setattr(manifest, "HOST_PLATFORMS", ())
    taken = [manifest.on_device(x) for x in arrays[:-1]]
    assert taken == [True] * 9 + [False]
    with jax.set_mesh(mesh):
        assert manifest.checksums(arrays) == host
    with jax.disable_jit(), jax.transfer_guard("disallow"):
        assert manifest.checksums(arrays) == host
    assert manifest.checksums(arrays) == host
    assert host[:-1] == [_reference_checksum(x) for x in arrays[:-1]]


def test_restore_checks_on_the_device_what_the_host_saved(monkeypatch, tmp_path):
    # A checkpoint summed on the host restores where the sums are computed on the
    # device, and the other way round; a flipped byte is found either way.
    from equinox_shard._checkpoint import manifest

    from .test_checkpoint_safety import _flip_byte_of

    mesh = auto_mesh(grid_shape(), ("data", "model"))
    values = np.random.default_rng(0).integers(0, 2**32, 4096, dtype=np.uint32)
    mesh_replicated = NamedSharding(mesh, P())
    state = {
        "w": jax.device_put(values.reshape(64, 64), NamedSharding(mesh, P("data"))),
        "b": jax.device_put(jnp.arange(8, dtype=jnp.bfloat16), mesh_replicated),
        "key": jax.random.key(1),
    }
    monkeypatch.setattr(manifest, "HOST_PLATFORMS", ("cpu", jax.default_backend()))
    eqxs.save(tmp_path / "host", state)
    monkeypatch.setattr(manifest, "HOST_PLATFORMS", ())
    eqxs.save(tmp_path / "device", state)
    for name in ("host", "device"):
        out = eqxs.restore(tmp_path / name, state)
        np.testing.assert_array_equal(np.asarray(out["w"]), values.reshape(64, 64))
        assert out["w"].sharding == state["w"].sharding
    _flip_byte_of(tmp_path / "host" / "arrays", values)
    with pytest.raises(ValueError, match=r"like\['w'\]: .* checksum"):
        eqxs.restore(tmp_path / "host", state)
