"""`eqxs.save` and `eqxs.restore`: checkpoints with orbax-checkpoint, restored straight
into each array's target sharding, on another layout, in another process, or across
processes; bad input refused before anything is read or written."""

import collections
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import typing

import equinox as eqx
import equinox_shard as eqxs
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optax
import pytest
from jax.sharding import make_single_device_sharding, NamedSharding, PartitionSpec as P

from . import checkpoint_worker as worker
from .helpers import (
    assert_same_values,
    auto_mesh,
    chip_mesh,
    explicit_mesh,
    grid_shape,
    nth_device,
    snapshot,
)
from .isolated import child_env, HANG_SECONDS, killed_after_first_line


pytest.importorskip("orbax.checkpoint")

WORKER = worker.__file__
# The MLP's weight matrices are split; everything else is replicated.
MATRIX = r"mlp\.layers\[\d\]\.weight$"
FSDP = eqxs.PathRules([(MATRIX, P("data"))], default=P())
TWO_D = eqxs.PathRules([(MATRIX, P("data", "model"))], default=P())


class Model(eqx.Module):
    mlp: eqx.nn.MLP
    norm: eqx.nn.BatchNorm
    scale: jax.Array
    name: str = eqx.field(static=True)
    label: str
    fn: object

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.mlp = eqx.nn.MLP(16, 8, 32, 2, key=k1)
        self.norm = eqx.nn.BatchNorm(8, "batch", mode="batch")
        self.scale = jax.random.normal(k2, (8,))
        self.name = "model"
        self.label = "a string leaf"
        self.fn = jax.nn.relu


def _optim():
    # MaskedState (with MaskedNode), EmptyState (the chain's clipping), Adam's state
    # with an int32 count.
    only_matrices = lambda t: jtu.tree_map(lambda x: x.ndim == 2, t)
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.masked(optax.adamw(1e-3), only_matrices),
    )


def _state(seed: int):
    """A training state of every kind: a Module with callables and strings and its
    `eqx.nn.State`, an optax state, a typed PRNG key array, an int counter, a NumPy
    array and a float."""
    key = jax.random.key(seed)
    model, bn_state = eqx.nn.make_with_state(Model)(key)
    params = eqx.filter(model, eqx.is_inexact_array)
    opt_state = _optim().init(params)
    # Moments that are not zero, so that the test sees them come back.
    opt_state = jtu.tree_map(
        lambda x: x + 0.5 if eqx.is_inexact_array(x) else x, opt_state
    )
    return {
        "model": model,
        "bn_state": bn_state,
        "opt_state": opt_state,
        "keys": jax.random.split(jax.random.fold_in(key, 1), 8),
        "step": 100 + seed,
        "lr": 0.5 + seed,
        "table": np.arange(8, dtype=np.int32) * (seed + 1),
        "note": None,
    }


def _put(tree, mesh, rules):
    with jax.set_mesh(mesh):
        return eqxs.filter_device_put(tree, rules)


def _arrays(tree):
    return [x for x in jtu.tree_leaves(tree) if eqx.is_array(x)]


def _targets(tree):
    """The leaves of `tree` that are restored as JAX arrays."""
    return [
        x
        for x in jtu.tree_leaves(tree)
        if isinstance(x, (jax.Array, jax.ShapeDtypeStruct))
    ]


def _expected_sharding(mesh, rules, tree):
    """One sharding per JAX array (or ShapeDtypeStruct) leaf of `tree`, as `rules`
    place it on `mesh`; written out from the rules, not from the code under test."""
    out = []
    for path, leaf in jtu.tree_flatten_with_path(tree)[0]:
        if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):
            split = re.search(MATRIX, jtu.keystr(path))
            spec = {FSDP: P("data"), TWO_D: P("data", "model")}[rules] if split else P()
            out.append(NamedSharding(mesh, spec))
    return out


def _assert_restored(out, saved_values, like, shardings):
    """`out` has `like`'s structure, every non-array leaf the object of `like`; every
    array the saved values; and every JAX array leaf the given sharding."""
    out_leaves, out_def = jtu.tree_flatten(out, is_leaf=lambda x: x is None)
    like_leaves, like_def = jtu.tree_flatten(like, is_leaf=lambda x: x is None)
    assert out_def == like_def
    for a, b in zip(out_leaves, like_leaves):
        if eqx.is_array(b) or isinstance(b, (jax.ShapeDtypeStruct, int, float)):
            continue
        assert a is b, (a, b)  # strings, functions, None, static structure
    assert_same_values(
        eqx.filter(out, eqx.is_array), eqx.filter(saved_values, eqx.is_array)
    )
    assert out["step"] == saved_values["step"] and type(out["step"]) is int
    assert out["lr"] == saved_values["lr"] and type(out["lr"]) is float
    # A NumPy leaf of `like` comes back as NumPy; everything else as JAX arrays.
    assert isinstance(out["table"], np.ndarray) == isinstance(like["table"], np.ndarray)
    jax_arrays = [x for x in _arrays(out) if isinstance(x, jax.Array)]
    assert len(jax_arrays) == len(_targets(like)) == len(shardings)
    for x, s in zip(jax_arrays, shardings):
        assert x.committed
        key = jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
        if key and isinstance(s, NamedSharding) and s.spec == P():
            # JAX labels a key array on P() as P(None,), whatever places it (on
            # more than one device).
            labels = (NamedSharding(s.mesh, P(None)), s)
            assert x.sharding in labels, (x.sharding, s)
        else:
            assert x.sharding == s, (x.sharding, s)


@pytest.mark.devices(2, reason="P('x') and P() are the same sharding on one device")
def test_round_trip_every_kind_of_leaf(tmp_path):
    mesh = auto_mesh(names=("data",))
    state = _put(_state(0), mesh, FSDP)
    saved = snapshot(state)
    eqxs.save(tmp_path / "ckpt", state)
    # `like`: the same state built the usual way, with other values.
    like = _put(_state(1), mesh, FSDP)
    out = eqxs.restore(tmp_path / "ckpt", like)
    _assert_restored(out, saved, like, _expected_sharding(mesh, FSDP, like))
    assert out["model"].fn is jax.nn.relu and out["model"].label == "a string leaf"
    assert jnp.issubdtype(out["keys"].dtype, jax.dtypes.prng_key)
    masked = out["opt_state"][1]
    assert type(masked) is optax.MaskedState
    assert type(out["opt_state"][0]) is optax.EmptyState
    # The BatchNorm state is an `eqx.nn.State`; its values come back too.
    assert type(out["bn_state"]) is eqx.nn.State


def test_restore_into_another_layout(tmp_path):
    # FSDP over 8 -> 4 x 2 data x model -> one device, bit for bit.
    state = _put(_state(0), auto_mesh(names=("data",)), FSDP)
    saved = snapshot(state)
    eqxs.save(tmp_path / "ckpt", state)
    like = eqx.filter_eval_shape(lambda: _state(1))  # no shardings at all

    two_d = auto_mesh(grid_shape(), ("data", "model"))
    with jax.set_mesh(two_d):  # bare PartitionSpecs from the rules
        out = eqxs.restore(tmp_path / "ckpt", like, TWO_D)
    _assert_restored(out, saved, like, _expected_sharding(two_d, TWO_D, like))
    assert out["model"].mlp.layers[0].weight.sharding.spec == P("data", "model")

    device = nth_device(3)
    out = eqxs.restore(tmp_path / "ckpt", like, device)
    n = len(_targets(like))
    _assert_restored(out, saved, like, [make_single_device_sharding(device)] * n)

    # A callable spec, and a whole `NamedSharding` on an Explicit mesh: the axis types
    # survive (orbax #2408).
    explicit = explicit_mesh(names=("x",))
    split = lambda x: x.ndim > 0 and x.shape[0] % 8 == 0
    rule = lambda x: NamedSharding(explicit, P("x") if split(x) else P())
    out = eqxs.restore(tmp_path / "ckpt", like, rule)
    expected = [rule(x) for x in _targets(like)]
    assert any(s.spec == P("x") for s in expected)
    _assert_restored(out, saved, like, expected)
    for x in _targets(out):
        assert x.sharding.mesh.axis_types == (jax.sharding.AxisType.Explicit,)  # pyright: ignore


def _make_state(key):
    model = eqx.nn.MLP(16, 8, 32, 2, key=key)
    opt_state = optax.adam(1e-3).init(eqx.filter(model, eqx.is_inexact_array))
    return model, opt_state


def test_like_from_filter_jit_eval_shape(tmp_path):
    # The abstract state that `filter_jit(init, out_shardings=rules).eval_shape` gives
    # inside `jax.set_mesh`: shardings on an abstract mesh, taken to the concrete one.
    mesh = auto_mesh(grid_shape(), ("data", "model"))
    init = eqxs.filter_jit(_make_state, out_shardings=TWO_D)
    with jax.set_mesh(mesh):
        state = init(jax.random.key(0))
        like = init.eval_shape(jax.random.key(1))
    saved = snapshot(state)
    eqxs.save(tmp_path / "ckpt", state)
    with jax.set_mesh(mesh):
        out = eqxs.restore(tmp_path / "ckpt", like)
    assert_same_values(eqx.filter(out, eqx.is_array), eqx.filter(saved, eqx.is_array))
    for x, y in zip(_arrays(out), _arrays(state), strict=True):
        assert x.sharding == y.sharding, (x.sharding, y.sharding)
    assert out[0].activation is like[0].activation

    # Without a mesh, or with another one, the abstract mesh cannot be mapped.
    abstract = [x for x in jtu.tree_leaves(like) if hasattr(x, "sharding")]
    if not any(
        isinstance(x.sharding.mesh, jax.sharding.AbstractMesh)
        for x in abstract
        if isinstance(x.sharding, NamedSharding)
    ):
        return  # this JAX reports concrete meshes; nothing more to check
    with pytest.raises(ValueError, match=r"like\[0\]\.layers\[0\]\.weight: its "):
        eqxs.restore(tmp_path / "ckpt", like)
    with jax.set_mesh(auto_mesh((2, 4), ("data", "model"))):
        with pytest.raises(ValueError, match="abstract mesh"):
            eqxs.restore(tmp_path / "ckpt", like)


def test_like_on_an_abstract_mesh(tmp_path):
    # `jax.eval_shape` inside `jax.set_mesh` reports shardings on an AbstractMesh
    # (orbax alone fails on them with "_device_assignment is not implemented").
    mesh = auto_mesh(grid_shape(), ("data", "model"))
    x = jax.device_put(np.arange(64.0, dtype=np.float32).reshape(8, 8))
    eqxs.save(tmp_path / "ckpt", {"x": x, "n": 1})
    spec = P("data", "model")
    abstract = NamedSharding(mesh.abstract_mesh, spec)
    like = {"x": jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=abstract), "n": 0}
    with jax.set_mesh(mesh):
        out = eqxs.restore(tmp_path / "ckpt", like)
    assert out["x"].sharding == NamedSharding(mesh, spec)
    np.testing.assert_array_equal(np.asarray(out["x"]), np.asarray(x))
    assert out["n"] == 1
    with pytest.raises(ValueError, match=r"like\['x'\]: its sharding .* abstract mesh"):
        eqxs.restore(tmp_path / "ckpt", like)
    with jax.set_mesh(auto_mesh((2, 4), ("data", "model"))):
        with pytest.raises(ValueError, match=r"the mesh set now is Mesh\('data': 2"):
            eqxs.restore(tmp_path / "ckpt", like)


#
# No device ever holds a whole array that its target splits.
#


def _device_bytes() -> dict:
    """Bytes of the buffers of every live JAX array, per device: `memory_stats()` where
    the device has it (GPU, TPU), else (CPU) the live buffers counted once each (a
    global array assembled from single-device arrays shares their buffers)."""
    devices = jax.devices()
    stats = [d.memory_stats() for d in devices]
    if all(stats):
        return {d.id: s["bytes_in_use"] for d, s in zip(devices, stats)}  # pyright: ignore
    buffers = {}
    for x in jax.live_arrays():
        try:
            for shard in x.addressable_shards:
                data = shard.data
                if jnp.issubdtype(data.dtype, jax.dtypes.prng_key):
                    data = jax.random.key_data(data)
                buffers[data.unsafe_buffer_pointer()] = (shard.device.id, data.nbytes)
        except Exception:  # deleted meanwhile
            continue
    out = collections.Counter()
    for device, nbytes in buffers.values():
        out[device] += nbytes
    return out


@contextlib.contextmanager
def peak_device_bytes():
    """The peak, per device, of the bytes held by live arrays above those held when
    the block starts, sampled every ~0.2 ms on another thread."""
    base = _device_bytes()
    peak = collections.Counter()
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            for d, n in _device_bytes().items():
                peak[d] = max(peak[d], n - base.get(d, 0))
            time.sleep(0.0002)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield peak
    finally:
        stop.set()
        thread.join()
        for d, n in _device_bytes().items():
            peak[d] = max(peak[d], n - base.get(d, 0))


@pytest.mark.devices(2, reason="one device holds the whole of every array")
def test_no_device_holds_a_whole_array(tmp_path):
    mesh = auto_mesh(names=("data",))
    sharding = NamedSharding(mesh, P("data"))
    big = {
        "a": jax.device_put(np.ones((2048, 1024), np.float32), sharding),
        "b": jax.device_put(np.full((1024, 1024), 2.0, np.float32), sharding),
    }
    whole = 2048 * 1024 * 4
    eqxs.save(tmp_path / "ckpt", big)
    eqx.tree_serialise_leaves(tmp_path / "naive.eqx", big)
    like = jtu.tree_map(  # shardings without buffers
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), big
    )
    del big

    with peak_device_bytes() as peak:
        out = eqxs.restore(tmp_path / "ckpt", like)
        jax.block_until_ready(out)
    shard = (2048 + 1024) * 1024 * 4 // 8  # this device's part of both arrays
    print("eqxs.restore: peak bytes per device", dict(peak))
    assert sorted(peak) == list(range(8))
    # Plus, briefly, each array's 4-byte checksum, computed where the array lies.
    checksums = 4 * len(like)
    assert all(shard <= n <= shard + checksums for n in peak.values()), (peak, shard)
    np.testing.assert_array_equal(np.asarray(out["a"]), 1.0)
    assert out["a"].sharding == sharding and out["b"].sharding == sharding
    del out

    # The measurement does see a whole array when there is one: the usual recipe
    # (deserialise onto one device, then place) holds all of "a" on device 0.
    with peak_device_bytes() as naive:
        zeros = jtu.tree_map(lambda x: jnp.zeros(x.shape, x.dtype), like)
        loaded = eqx.tree_deserialise_leaves(tmp_path / "naive.eqx", zeros)
        out = eqxs.filter_device_put(loaded, sharding)
        jax.block_until_ready(out)
        del zeros, loaded
    print("deserialise + filter_device_put: peak bytes per device", dict(naive))
    assert naive[0] >= whole


#
# Errors, before anything is read or written.
#


@pytest.fixture
def no_array_reads(monkeypatch):
    """Fails the test if orbax reads (or writes) any array."""
    import orbax.checkpoint as ocp

    def boom(*args, **kwargs):
        raise AssertionError("orbax touched the arrays")

    for name in ("restore", "async_restore", "save", "async_save"):
        if hasattr(ocp.PyTreeCheckpointHandler, name):
            monkeypatch.setattr(ocp.PyTreeCheckpointHandler, name, boom)


@pytest.fixture
def saved(tmp_path):
    state = _put(_state(0), auto_mesh(names=("data",)), FSDP)
    eqxs.save(tmp_path / "ckpt", state)
    return tmp_path / "ckpt", state


def test_like_differs_from_checkpoint(saved, no_array_reads):
    path, state = saved
    like = eqx.filter_eval_shape(lambda: state)

    wider = eqx.tree_at(
        lambda s: s["model"].mlp.layers[0].weight,
        like,
        jax.ShapeDtypeStruct((32, 17), jnp.float32),
    )
    with pytest.raises(ValueError) as e:
        eqxs.restore(path, wider)
    assert str(e.value) == (
        f"like['model'].mlp.layers[0].weight: the checkpoint at {path} has an array "
        "of shape (32, 16) and dtype float32 here, but `like` has an array of shape "
        "(32, 17) and dtype float32."
    )

    half = eqx.tree_at(
        lambda s: s["model"].scale,
        like,
        jax.ShapeDtypeStruct((8,), jnp.float16),
    )
    with pytest.raises(ValueError, match=r"like\['model'\]\.scale: .* dtype float32 "):
        eqxs.restore(path, half)

    counter = dict(like, step=np.int64(3))
    with pytest.raises(ValueError, match=r"like\['step'\]: .* a Python int \(100\)"):
        eqxs.restore(path, counter)

    extra = dict(like, extra=jax.ShapeDtypeStruct((2,), jnp.float32))
    with pytest.raises(ValueError) as e:
        eqxs.restore(path, extra)
    assert str(e.value).startswith(
        "like['extra']: `like` has an array of shape (2,) and dtype float32 here, but "
        f"the checkpoint at {path} has no saved leaf at this key path"
    )

    missing = {k: v for k, v in like.items() if k != "keys"}
    with pytest.raises(ValueError) as e:
        eqxs.restore(path, missing)
    assert str(e.value) == (
        f"like['keys']: the checkpoint at {path} has a PRNG key array of shape (8,) "
        "and dtype key<fry> here, but `like` has no array or Python scalar at this "
        "key path."
    )


def test_missing_path_and_spec_that_does_not_divide(saved, no_array_reads, tmp_path):
    path, state = saved
    like = eqx.filter_eval_shape(lambda: state)
    with pytest.raises(FileNotFoundError, match="No checkpoint at .*nowhere"):
        eqxs.restore(tmp_path / "nowhere", like)
    with pytest.raises(ValueError, match="not a checkpoint written by"):
        eqxs.restore(tmp_path, like)
    three = jax.make_mesh(
        (3,),
        ("data",),
        axis_types=(jax.sharding.AxisType.Auto,),
        devices=jax.devices()[:3],
    )
    rules = eqxs.PathRules([(r"bias$", P("data"))], default=P())
    with jax.set_mesh(three), pytest.raises(ValueError) as e:
        eqxs.restore(path, like, rules)
    assert str(e.value) == (
        "like['model'].mlp.layers[0].bias: dimension 0 of shape (32,) has size 32, "
        "which is not divisible by the 3 devices of mesh axes 'data' (PartitionSpec "
        "P('data',), mesh {'data': 3})."
    )


def test_save_errors_write_nothing(tmp_path, no_array_reads):
    state = _state(0)
    with pytest.raises(ValueError, match=r"tree\['x'\]: cannot save the abstract"):
        eqxs.save(tmp_path / "a", dict(state, x=jax.ShapeDtypeStruct((2,), jnp.int32)))
    donated = jnp.ones(3)
    donated.delete()
    with pytest.raises(RuntimeError, match=r"tree\[.x.\]: this array has been deleted"):
        eqxs.save(tmp_path / "b", dict(state, x=donated))
    (tmp_path / "c").mkdir()
    with pytest.raises(FileExistsError, match="overwrite=True"):
        eqxs.save(tmp_path / "c", state)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


# Dtypes that orbax-checkpoint cannot write (TensorStore has no such data type, on
# every version tried): refused before anything is written, naming the leaf, where
# orbax failed partway through its write, on its threads, without naming it.
def _on_cpu(dtype):
    # Made by a transfer, not a computation: a TPU's compiler aborts on these dtypes.
    return lambda: jax.device_put(np.ones(3, dtype), jax.devices("cpu")[0])


_UNSTORABLE = {
    "uint2": _on_cpu(jnp.uint2),
    "uint4": _on_cpu(jnp.uint4),
    "float8_e4m3": _on_cpu(jnp.float8_e4m3),
    "float0": lambda: np.zeros(3, jax.dtypes.float0),
    "str": lambda: np.array(["a", "b"]),
    "bytes": lambda: np.array([b"a", b"bc"]),
    "object": lambda: np.array([1, "a"], object),
    "datetime64": lambda: np.array(["2020-01-01"], "datetime64[D]"),
    "timedelta64": lambda: np.array([1], "timedelta64[s]"),
    "void": lambda: np.zeros(2, "V4"),
    "structured": lambda: np.zeros(2, [("a", "i4")]),
    "longdouble": lambda: np.array([1.0], np.longdouble),
    "clongdouble": lambda: np.array([1.0], np.clongdouble),
    "str scalar": lambda: np.str_("a"),
}


@pytest.mark.parametrize("dtype", list(_UNSTORABLE))
def test_a_dtype_orbax_cannot_write_is_refused_before_writing(tmp_path, capfd, dtype):
    tree = {"params": {"w": jnp.ones(4)}, "extra": [_UNSTORABLE[dtype]()]}
    message = r"^tree\['extra'\]\[0\]: orbax-checkpoint cannot write an array of dtype"
    with pytest.raises(ValueError, match=message):
        eqxs.save(tmp_path / "ckpt", tree)
    manager = eqxs.CheckpointManager(tmp_path / "steps")
    with pytest.raises(ValueError, match=message.replace("tree", "state")):
        manager.save(0, tree)
    manager.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["steps"]
    assert [p.name for p in (tmp_path / "steps").iterdir()] == []
    assert capfd.readouterr().err == ""


def test_every_dtype_orbax_writes_is_saved(tmp_path):
    dtypes = ["int2", "int4", "float4_e2m1fn", "float8_e3m4", "float8_e4m3fn"]
    dtypes += ["float8_e4m3b11fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "bfloat16"]
    arrays = {}
    for d in dtypes:
        try:
            arrays[d] = jnp.arange(4).astype(getattr(jnp, d))
        except jax.errors.JaxRuntimeError:  # TPU v5e: INT2 "not supported for rank 1"
            assert jax.default_backend() != "cpu", d
    tree: dict[str, typing.Any] = {
        **arrays,
        **{f"numpy {d}": np.arange(4).astype(getattr(jnp, d)) for d in dtypes},
    }
    eqxs.save(tmp_path / "ckpt", tree)
    out = eqxs.restore(tmp_path / "ckpt", tree)
    for name, x in tree.items():
        assert type(out[name]) is type(x) and out[name].dtype == x.dtype, name
        assert np.asarray(out[name]).tobytes() == np.asarray(x).tobytes(), name


def test_weak_type_comes_back_as_equinox_gives_it(tmp_path):
    # Neither orbax nor `eqx.tree_deserialise_leaves` keeps a weak type, even where
    # `like` has one: `restore` gives the same (docs/checkpoints.md, "Restore").
    tree = {"lr": jnp.asarray(0.5), "w": jnp.arange(3.0) + jnp.asarray(1.0)}
    assert tree["lr"].weak_type
    eqxs.save(tmp_path / "ckpt", tree)
    eqx.tree_serialise_leaves(tmp_path / "tree.eqx", tree)
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=x.weak_type), tree
    )
    for like in (tree, abstract):
        ours = eqxs.restore(tmp_path / "ckpt", like)
        theirs = eqx.tree_deserialise_leaves(tmp_path / "tree.eqx", tree)
        for name in tree:
            assert ours[name].weak_type == theirs[name].weak_type, name
            assert ours[name].dtype == tree[name].dtype == jnp.float32
            assert np.array_equal(np.asarray(ours[name]), np.asarray(tree[name]))
    assert not ours["lr"].weak_type


def test_overwrite(tmp_path):
    eqxs.save(tmp_path / "ckpt", {"x": jnp.zeros(4), "n": 1})
    eqxs.save(tmp_path / "ckpt", {"x": jnp.ones(4), "n": 2}, overwrite=True)
    out = eqxs.restore(tmp_path / "ckpt", {"x": jnp.zeros(4), "n": 0})
    np.testing.assert_array_equal(np.asarray(out["x"]), 1.0)
    assert out["n"] == 2


#
# Fresh processes: a clean stderr, a save killed midway, exact resumption, and
# several processes.
#


def _run(*args, timeout=HANG_SECONDS):
    env = child_env()
    return subprocess.run(
        [sys.executable, WORKER, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def test_nothing_on_stderr(tmp_path):
    proc = _run("clean", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "clean: ok\n"
    assert proc.stderr == ""


def test_save_killed_midway(tmp_path):
    # Everything written, not yet finalised.
    line, returncode = killed_after_first_line(WORKER, "killed", str(tmp_path))
    assert line == "WRITTEN\n"
    assert returncode == -signal.SIGKILL
    leftovers = sorted(p.name for p in tmp_path.iterdir())
    assert len(leftovers) == 1 and leftovers[0].startswith("ckpt.orbax-checkpoint-tmp")
    like = worker.reference_state()
    with pytest.raises(FileNotFoundError) as e:
        eqxs.restore(tmp_path / "ckpt", like)
    assert str(e.value) == (
        f"No checkpoint at {tmp_path / 'ckpt'}. Found {leftovers[0]} next to it: a "
        "save that was interrupted before it finished; that checkpoint is incomplete "
        "and cannot be restored."
    )
    # A new save to the same path works, restores, and removes the leftover.
    state = worker.reference_state()
    eqxs.save(tmp_path / "ckpt", state)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    out = eqxs.restore(tmp_path / "ckpt", like)
    assert_same_values(eqx.filter(out, eqx.is_array), eqx.filter(state, eqx.is_array))


@pytest.mark.slow
def test_resume_is_exact_on_every_layout(tmp_path):
    # 30 steps uninterrupted (saving at step 15) in one process; in a fresh one,
    # restore step 15 into `init.eval_shape`'s abstract state and train 15 more.
    layouts = ["data", "fsdp", "tensor", "2d"]
    first = _run("train", tmp_path, *layouts)
    assert first.returncode == 0, first.stderr[-4000:]
    second = _run("resume", tmp_path, *layouts)
    assert second.returncode == 0, second.stderr[-4000:]
    assert second.stderr == ""
    for name in layouts:
        a = np.load(tmp_path / name / "uninterrupted.npz")
        b = np.load(tmp_path / name / "resumed.npz")
        assert len(a.files) == 52  # 17 parameters, Adam's 2 x 17 moments and count
        for k in a.files:
            np.testing.assert_array_equal(a[k], b[k], err_msg=f"{name} {k}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("checksums", ["host", "device"])
def test_two_processes_then_one(tmp_path, checksums):
    # `device`: the checksums summed on the devices of both processes (as on an
    # accelerator), then checked on the host by the one process.
    coordinator = f"127.0.0.1:{_free_port()}"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, "multiprocess", str(tmp_path), str(p), "2"]
            + [coordinator, checksums],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
        for p in range(2)
    ]
    try:
        outputs = [proc.communicate(timeout=HANG_SECONDS)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    for proc, output in zip(procs, outputs):
        assert proc.returncode == 0, output[-4000:]
    reference = worker.reference_state()
    mesh = auto_mesh(names=("data",))
    reference = _put(reference, mesh, FSDP)
    values = {
        jtu.keystr(p): np.asarray(
            jax.random.key_data(x)
            if jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
            else x
        )
        for p, x in jtu.tree_flatten_with_path(reference)[0]
        if eqx.is_array(x)
    }
    devices = {0: set(), 1: set()}
    for p in range(2):
        lines = (tmp_path / f"p{p}.txt").read_text().splitlines()
        assert len(lines) == 4 * len(values)  # each of its 4 devices, every array
        for n, line in enumerate(lines):
            path, device, index = json.loads(line)
            devices[p].add(device)
            shard = np.load(tmp_path / f"p{p}_{n}.npy")
            expected = values[path][tuple(slice(a, b) for a, b in index)]
            np.testing.assert_array_equal(shard, expected)
    assert len(devices[0]) == len(devices[1]) == 4
    assert not devices[0] & devices[1]
    # Each process wrote its own shards, into its own part of orbax's OCDBT store.
    written = sorted(p.name for p in (tmp_path / "ckpt" / "arrays").iterdir())
    assert "ocdbt.process_0" in written and "ocdbt.process_1" in written, written

    # The same checkpoint, restored by one process on 8 devices.
    like = eqx.filter_eval_shape(worker.reference_state)
    two_d = auto_mesh(grid_shape(), ("data", "model"))
    rules = eqxs.PathRules([(r"weight$", P("data", "model"))], default=P())
    with jax.set_mesh(two_d):
        out = eqxs.restore(tmp_path / "ckpt", like, rules)
    assert_same_values(
        eqx.filter(out, eqx.is_array), eqx.filter(reference, eqx.is_array)
    )
    for path, x in jtu.tree_flatten_with_path(out)[0]:
        if isinstance(x, jax.Array) and x.dtype != jax.random.key(0).dtype:
            spec = P("data", "model") if jtu.keystr(path).endswith("weight") else P()
            assert x.sharding == NamedSharding(two_d, spec), jtu.keystr(path)
    assert out["name"] is like["name"] and out["step"] == 3
    assert out["model"].activation is like["model"].activation


def _bits(x):
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x).reshape(-1).view(np.uint8)


@pytest.mark.accelerator
def test_round_trip_bit_for_bit_on_a_chip(tmp_path):
    # Every kind of leaf, through the chip's memory both ways: the bits come back
    # (NaN payloads, -0.0, bfloat16 and a typed key included), on the shardings of
    # `like`, which holds other values.
    mesh = chip_mesh(("data",))
    n = jax.device_count()

    def state(seed):
        rng = np.random.default_rng(seed)
        weights = rng.standard_normal((64 * n, 256)).astype(np.float32)
        weights[0, :3] = [np.nan, -0.0, np.inf]
        return {
            "w": jnp.asarray(weights),
            "bf16": jnp.asarray(rng.standard_normal((32 * n, 128)), jnp.bfloat16),
            "count": jnp.asarray(seed + 7, jnp.int32),
            "key": jax.random.key(seed),
            "name": "a string leaf",
            "step": 3,
        }

    rules = eqxs.PathRules([(r"w|bf16", P("data"))], default=P())
    saved = _put(state(0), mesh, rules)
    bits = {k: _bits(v) for k, v in saved.items() if eqx.is_array(v)}
    eqxs.save(tmp_path / "ckpt", saved)
    like = _put(state(1), mesh, rules)
    out = eqxs.restore(tmp_path / "ckpt", like)
    assert set(bits) == {"w", "bf16", "count", "key"}
    for name, expected in bits.items():
        assert out[name].dtype == saved[name].dtype, name
        assert out[name].sharding == like[name].sharding, name
        assert np.array_equal(_bits(out[name]), expected), name
    assert out["name"] is like["name"] and out["step"] == 3
    # Nothing lost: the saved state is intact.
    assert all(np.array_equal(_bits(saved[k]), v) for k, v in bits.items())
