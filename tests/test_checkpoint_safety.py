"""The five defects of issue 34 in `save`/`restore`: saves from several threads, a
zero-size array, corrupted data, `overwrite=True` killed midway (and leftovers), and a
typed PRNG key restored without a sharding."""

import pathlib
import threading

import equinox as eqx
import equinox_shard as eqxs
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from . import checkpoint_worker as worker
from .helpers import (
    assert_same_values,
    auto_mesh,
    explicit_mesh,
    grid_shape,
    nth_device,
)
from .isolated import killed_after_first_line, run_isolated


pytest.importorskip("orbax.checkpoint")


def test_saves_from_four_threads(tmp_path):
    # orbax numbers its directory-creation signals per process, not per save: two
    # composite saves at once took each other's ("...leaves.orbax-checkpoint-tmp/
    # metadata" not found).
    mesh = auto_mesh(names=("data",))
    states = [
        {"x": jax.device_put(jnp.arange(4096.0) + i, NamedSharding(mesh, P("data"))),
         "n": i}
        for i in range(4)
    ]  # fmt: skip
    errors = []

    def save(i):
        try:
            eqxs.save(tmp_path / f"ckpt{i}", states[i])
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(repr(e))

    threads = [threading.Thread(target=save, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for i in range(4):
        out = eqxs.restore(tmp_path / f"ckpt{i}", states[0])
        assert out["n"] == i
        np.testing.assert_array_equal(np.asarray(out["x"]), np.arange(4096.0) + i)


def test_zero_size_arrays(tmp_path):
    # Saved and restored (orbax alone refuses them), on any target sharding.
    mesh = auto_mesh(names=("data",))
    state = {
        "empty": jnp.zeros((0, 3)),
        "rows": jax.device_put(jnp.zeros((8, 0), jnp.int32),
                               NamedSharding(mesh, P("data"))),
        "keys": jax.random.split(jax.random.key(0), 0),
        "table": np.zeros((0,), np.int16),
        "x": jnp.arange(3.0),
    }  # fmt: skip
    eqxs.save(tmp_path / "ckpt", state)
    like = eqx.filter_eval_shape(lambda: state)
    with jax.set_mesh(mesh):
        out = eqxs.restore(tmp_path / "ckpt", dict(like, table=state["table"]), P())
    for name in ("empty", "rows", "keys"):
        assert out[name].shape == state[name].shape
        assert out[name].dtype == state[name].dtype
        assert out[name].committed
        assert out[name].sharding.is_equivalent_to(
            NamedSharding(mesh, P()), out[name].ndim
        )
    assert isinstance(out["table"], np.ndarray) and out["table"].dtype == np.int16
    assert out["table"].shape == (0,)
    np.testing.assert_array_equal(np.asarray(out["x"]), np.arange(3.0))


def _flip_byte_of(directory: pathlib.Path, values: np.ndarray) -> None:
    """Flips one byte inside the stored bytes of `values` (random, so stored raw)."""
    pattern = values[1000:1004].tobytes()
    for f in sorted(directory.rglob("*")):
        if f.is_file() and (i := f.read_bytes().find(pattern)) >= 0:
            data = bytearray(f.read_bytes())
            data[i + 1] ^= 0xFF
            f.write_bytes(bytes(data))
            return
    raise AssertionError("the array's bytes were not found")


@pytest.mark.parametrize("kind", ["array", "key", "numpy"])
def test_corruption_names_the_leaf(tmp_path, kind):
    values = np.random.default_rng(0).integers(0, 2**32, 4096, dtype=np.uint32)
    if kind == "array":
        mesh = auto_mesh(grid_shape(), ("data", "model"))
        leaf = jax.device_put(values.reshape(64, 64), NamedSharding(mesh, P("data")))
        values = np.asarray(leaf).reshape(-1)
    elif kind == "key":
        leaf = jax.random.wrap_key_data(jnp.asarray(values.reshape(2048, 2)))
    else:
        leaf = values
    state = {"a": jnp.arange(16.0), "w": leaf, "n": 1}
    eqxs.save(tmp_path / "ckpt", state)
    _flip_byte_of(tmp_path / "ckpt" / "arrays", values)
    with pytest.raises(ValueError, match=r"like\['w'\]: .* checksum"):
        eqxs.restore(tmp_path / "ckpt", state)
    with pytest.raises(ValueError, match=r"like\['w'\]: .* checksum"):
        eqxs.restore(tmp_path / "ckpt", state, nth_device(3))


def test_key_without_sharding_is_not_committed(tmp_path):
    # `jax.eval_shape` inside `jax.set_mesh` gives a key (and a scalar) no sharding;
    # restored committed to device 0, the next step on the mesh failed with
    # "Received incompatible devices ... argument key".
    mesh = explicit_mesh(names=("data",))

    def make():
        return {"key": jax.random.key(0), "count": jnp.zeros((), jnp.int32),
                "x": jnp.arange(8.0)}  # fmt: skip

    with jax.set_mesh(mesh):
        state = make()
        eqxs.save(tmp_path / "ckpt", state)
        out = eqxs.restore(tmp_path / "ckpt", jax.eval_shape(make))
    assert not out["key"].committed and not out["count"].committed
    assert out["x"].sharding == state["x"].sharding
    with jax.set_mesh(mesh):
        y = jax.jit(lambda s: jax.random.normal(s["key"], (8,)) + s["x"])(out)
        ref = jax.jit(lambda s: jax.random.normal(s["key"], (8,)) + s["x"])(state)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(ref))
    # A `like` array that is not committed: the same.
    plain = {"key": jax.random.key(1), "count": jnp.zeros((), jnp.int32)}
    eqxs.save(tmp_path / "plain", plain)
    out = eqxs.restore(tmp_path / "plain", plain)
    assert not out["key"].committed and not out["count"].committed
    assert_same_values(out, plain)


def _killed_overwrite(directory: pathlib.Path, phase: str) -> str:
    return killed_after_first_line(worker.__file__, "overwrite", str(directory), phase)[
        0
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    "phase, survivor",
    [("finalize", "old"), ("renamed", "new"), ("between", "new")],
)
def test_overwrite_killed_at_each_phase(tmp_path, phase, survivor):
    # finalize: the new one written, not finalised; renamed: in place, the old one
    # not yet removed; between: between the two renames.
    line = _killed_overwrite(tmp_path, phase)
    assert line == "WRITTEN\n"
    out = eqxs.restore(tmp_path / "ckpt", worker.overwrite_state("old"))
    assert_same_values(out, worker.overwrite_state(survivor))
    # The next save cleans up whatever the killed one left.
    eqxs.save(tmp_path / "ckpt", worker.overwrite_state("next"), overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    out = eqxs.restore(tmp_path / "ckpt", worker.overwrite_state("old"))
    assert_same_values(out, worker.overwrite_state("next"))


def _data_file_of(directory: pathlib.Path, values: np.ndarray) -> pathlib.Path:
    pattern = values[1000:1004].tobytes()
    for f in sorted(directory.rglob("*")):
        if f.is_file() and f.read_bytes().find(pattern) >= 0:
            return f
    raise AssertionError("the array's bytes were not found")


@pytest.mark.parametrize("manager", [False, True])
@pytest.mark.parametrize("damage", ["delete", "truncate"])
def test_missing_or_truncated_data_names_the_leaf(tmp_path, damage, manager):
    # Was: a TensorStore error naming no leaf, and sometimes "Event loop is closed"
    # tracebacks on stderr from the reads still in flight.
    code = f"""
        import pathlib
        import equinox_shard as eqxs
        import jax.numpy as jnp
        import numpy as np
        from jax.sharding import NamedSharding, PartitionSpec as P

        mesh = jax.make_mesh((8,), ("data",))
        values = np.random.default_rng(0).integers(0, 2**32, 2**16, dtype=np.uint32)
        w = jax.device_put(values.reshape(256, 256), NamedSharding(mesh, P("data")))
        state = {{"a": jnp.arange(4.0), "layers": [{{"w": w}}], "n": 1}}
        directory = pathlib.Path({str(tmp_path)!r})
        if {manager}:
            with eqxs.CheckpointManager(directory) as manager:
                manager.save(3, state)
            ckpt = directory / "3"
        else:
            ckpt = directory / "ckpt"
            eqxs.save(ckpt, state)
        pattern = values[1000:1004].tobytes()
        (data,) = [f for f in ckpt.rglob("*")
                   if f.is_file() and f.read_bytes().find(pattern) >= 0]
        if {damage!r} == "delete":
            data.unlink()
        else:
            data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
        try:
            if {manager}:
                with eqxs.CheckpointManager(directory) as manager:
                    manager.restore(state)
            else:
                eqxs.restore(ckpt, state)
        except Exception as e:
            report([type(e).__name__, str(e)])
        else:
            report(None)
    """
    out = run_isolated(code, timeout=600)
    assert out.returncode == 0, out
    assert out.result is not None, out
    kind, message = out.result
    assert kind == "ValueError", out
    assert message.startswith("like['layers'][0]['w']: "), message
    assert ("missing" if damage == "delete" else "truncated") in message, message
    assert "Event loop is closed" not in out.output, out
    assert "Traceback" not in out.output, out


@pytest.mark.parametrize("shardings", [None, "device"])
@pytest.mark.parametrize("dtype", [np.int64, np.float64])
def test_64_bit_leaf_restored_as_a_jax_array_is_refused_not_cast(
    tmp_path, dtype, shardings
):
    # Found by the new-user trial: without x64, a 64-bit leaf restored into a JAX
    # `like` came back cast to 32 bits (2**40 + 1 as 1), or was called damaged.
    value = np.array([2**40 + 1, 3], dtype)
    path = tmp_path / "ckpt"
    eqxs.save(path, {"v": value})
    like = {"v": jax.ShapeDtypeStruct((2,), dtype)}
    targets = None if shardings is None else jax.devices()[0]
    with pytest.raises(ValueError, match=r"like\['v'\].*jax_enable_x64"):
        eqxs.restore(path, like, shardings=targets)
    # As NumPy it comes back bit for bit.
    restored = eqxs.restore(path, {"v": np.empty(2, dtype)})["v"]
    assert type(restored) is np.ndarray and restored.dtype == dtype
    np.testing.assert_array_equal(restored, value)
