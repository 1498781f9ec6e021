"""`jax.memory.Space` as a spec leaf: a subtree moved to host (or device) memory, each
array keeping its sharding, as `jax.device_put(x, Space.Host)` moves one array. The
oracle is `jax.device_put` on each leaf (eagerly and inside `jax.jit`)."""

import equinox as eqx
import equinox_shard as eqxs
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from .helpers import auto_mesh, chip_mesh


Space = jax.memory.Space


def _host_copy(tree):
    return jtu.tree_map(
        lambda x: np.array(x, copy=True), eqx.filter(tree, eqx.is_array)
    )


def _sharded_mlp(getkey, mesh):
    model = eqx.nn.MLP(8, 8, 16, 2, key=getkey())
    rules = eqxs.PathRules([(r"weight$", P("x", None))], default=P())
    with jax.set_mesh(mesh):
        return eqxs.filter_device_put(model, rules)


def _assert_moved(out, tree, space):
    kind = "pinned_host" if space is Space.Host else "device"
    for x, y in zip(jtu.tree_leaves(out), jtu.tree_leaves(tree)):
        if not eqx.is_array(y):
            assert x is y
            continue
        expected = jax.device_put(y, space)  # the oracle
        assert x.sharding == expected.sharding
        assert x.sharding.memory_kind == kind
        # The sharding is kept: only the memory kind changes.
        same = x.sharding.with_memory_kind(y.sharding.memory_kind)
        assert same.is_equivalent_to(y.sharding, y.ndim)
        assert x.committed
        assert np.array_equal(np.asarray(x), np.asarray(expected))


@pytest.mark.parametrize("space", [Space.Device, Space.Host])
def test_unpinned_host_is_moved_to_either_space(space):
    # `unpinned_host` is neither `Space.Device`'s memory nor `Space.Host`'s
    # (`pinned_host`): `jax.device_put` moves it to each, as `filter_device_put` must.
    device = jax.devices()[0]
    one = jax.sharding.make_single_device_sharding(device, memory_kind="unpinned_host")
    tree = {"w": jax.device_put(jnp.arange(4.0), one)}
    expected = np.array(tree["w"], copy=True)
    try:
        jax.device_put(tree["w"], space)
    except jax.errors.JaxRuntimeError as e:
        # JAX refuses it too (a TPU v5e with JAX 0.10.2: "Executable(jit_device_put)
        # expected parameter 0 of size 512 (f32[4]{0:T(128)S(6)})"): so may we.
        with pytest.raises(type(e)):
            eqxs.filter_device_put(tree, space)
    else:
        _assert_moved(eqxs.filter_device_put(tree, space), tree, space)
    assert not tree["w"].is_deleted()
    assert np.array_equal(np.asarray(tree["w"]), expected)


def test_filter_device_put_moves_a_model_and_back(getkey):
    mesh = auto_mesh()
    model = _sharded_mlp(getkey, mesh)
    before = _host_copy(model)
    host = eqxs.filter_device_put(model, Space.Host)
    _assert_moved(host, model, Space.Host)
    assert not any(
        x.is_deleted() for x in jtu.tree_leaves(eqx.filter(model, eqx.is_array))
    )
    assert jtu.tree_all(jtu.tree_map(np.array_equal, _host_copy(model), before))
    back = eqxs.filter_device_put(host, Space.Device)
    _assert_moved(back, host, Space.Device)
    # Already there: the same objects, as for a sharding (`jax.device_put` copies).
    again = eqxs.filter_device_put(host, Space.Host)
    for x, y in zip(jtu.tree_leaves(again), jtu.tree_leaves(host)):
        assert x is y


def test_optimiser_state_offloaded_by_path_rules(getkey):
    mesh = auto_mesh()
    model = _sharded_mlp(getkey, mesh)
    state = optax.adam(1e-3).init(eqx.filter(model, eqx.is_array))
    rules = eqxs.PathRules([(r"\.(mu|nu)\.", Space.Host)], default=None)
    out = eqxs.filter_device_put(state, rules)
    for path, x in jtu.tree_flatten_with_path(out)[0]:
        name = jtu.keystr(path)
        if ".mu." in name or ".nu." in name:
            assert x.sharding.memory_kind == "pinned_host", name
        else:
            assert x.sharding.memory_kind in (None, "device"), name
    assert [x.shape for x in jtu.tree_leaves(out)] == [
        x.shape for x in jtu.tree_leaves(state)
    ]


def test_typed_key_and_numpy_leaves():
    tree = {"key": jax.random.key(0), "x": np.arange(4.0, dtype=np.float32)}
    out = eqxs.filter_device_put(tree, Space.Host)
    for name in ("key", "x"):
        assert out[name].sharding.memory_kind == "pinned_host"
        assert out[name].sharding == jax.device_put(tree[name], Space.Host).sharding
    assert np.array_equal(
        np.asarray(jax.random.key_data(out["key"])),
        np.asarray(jax.random.key_data(tree["key"])),
    )


@pytest.mark.parametrize("shard", ("filter_shard", "filter_device_put"))
def test_inside_a_trace_as_jax_device_put(shard):
    mesh = auto_mesh()
    x = jax.device_put(jnp.arange(16.0), NamedSharding(mesh, P("x")))
    fn = getattr(eqxs, shard)

    @eqx.filter_jit
    def ours(x):
        return fn(x * 2, Space.Host)

    @jax.jit
    def oracle(x):
        return jax.device_put(x * 2, Space.Host)

    got, expected = ours(x), oracle(x)
    assert got.sharding == expected.sharding
    assert got.sharding.memory_kind == "pinned_host"
    assert jnp.array_equal(jax.device_put(got, Space.Device), x * 2)


def test_filter_jit_out_shardings(getkey):
    mesh = auto_mesh()
    model = _sharded_mlp(getkey, mesh)

    def step(model, x):
        return jax.vmap(model)(x), model

    ours = eqxs.filter_jit(step, out_shardings=(None, Space.Host))

    @jax.jit
    def oracle(dynamic, x):
        y, out = step(
            eqx.combine(dynamic, eqx.filter(model, eqx.is_array, inverse=True)), x
        )
        return y, jtu.tree_map(
            lambda a: jax.device_put(a, Space.Host), eqx.filter(out, eqx.is_array)
        )

    x = jnp.ones((8, 8))
    y, out = ours(model, x)
    y_ref, out_ref = oracle(eqx.filter(model, eqx.is_array), x)
    assert y.sharding.memory_kind in (None, "device")
    assert jnp.array_equal(y, y_ref)
    for a, b in zip(jtu.tree_leaves(out), jtu.tree_leaves(out_ref)):
        assert a.sharding == b.sharding and a.sharding.memory_kind == "pinned_host"
        assert jnp.array_equal(
            jax.device_put(a, Space.Device), jax.device_put(b, Space.Device)
        )
    assert out.activation is model.activation
    with jax.disable_jit():
        _, out = ours(model, x)
    arrays = jtu.tree_leaves(eqx.filter(out, eqx.is_array))
    assert {a.sharding.memory_kind for a in arrays} == {"pinned_host"}


def test_refused_in_in_shardings_naming_the_leaf(getkey):
    mesh = auto_mesh()
    model = _sharded_mlp(getkey, mesh)
    f = eqxs.filter_jit(lambda model, x: x, in_shardings=(Space.Host, None))
    with pytest.raises(TypeError, match=r"model\.layers\[0\]\.weight: `in_shardings` "):
        f(model, jnp.ones(2))
    assert not model.layers[0].weight.is_deleted()


def test_refused_where_only_placement_takes_it():
    with pytest.raises(TypeError, match=r"local_data: a `jax.memory.Space`.*only"):
        eqxs.filter_make_array_from_process_local_data(
            Space.Host, np.ones(8, np.float32)
        )


def test_space_any_is_not_a_spec_leaf():
    with pytest.raises(TypeError, match=r"MemorySpace.*`Space.Any` names no memory"):
        eqxs.filter_device_put(jnp.ones(2), Space.Any)


def test_checkpoint_of_an_offloaded_state(getkey, tmp_path):
    mesh = auto_mesh()
    model = _sharded_mlp(getkey, mesh)
    state = optax.adam(1e-3).init(eqx.filter(model, eqx.is_array))
    host = eqxs.filter_device_put(state, Space.Host)
    before = _host_copy(host)
    eqxs.save(tmp_path / "state", host)
    restored = eqxs.restore(tmp_path / "state", host)
    for x, y in zip(jtu.tree_leaves(restored), jtu.tree_leaves(host)):
        assert x.sharding == y.sharding and x.sharding.memory_kind == "pinned_host"
    assert jtu.tree_all(jtu.tree_map(np.array_equal, _host_copy(restored), before))
    on_device = eqxs.restore(tmp_path / "state", state)
    for x, y in zip(jtu.tree_leaves(on_device), jtu.tree_leaves(state)):
        assert x.sharding == y.sharding
    assert jtu.tree_all(jtu.tree_map(np.array_equal, _host_copy(on_device), before))


def test_shard_map_path_rules_with_a_space_name_the_rule():
    # `filter_shard_map` takes only `PartitionSpec`s: a `PathRules` holding a `Space`
    # is refused before anything runs, naming where it is and which rule holds it.
    mesh = auto_mesh()
    tree = {"a": jnp.ones(8), "b": jnp.ones(8)}
    rules = eqxs.PathRules([(r"\['a'\]", Space.Host)], default=P("x"))
    with pytest.raises(TypeError) as info:
        eqxs.filter_shard_map(
            lambda t: t, mesh=mesh, in_specs=(rules,), out_specs=P("x")
        )(tree)
    assert str(info.value).startswith(
        "in_specs[0] (its rule \"\\\\['a'\\\\]\"): a `filter_shard_map` specification"
    ), str(info.value)
    rules = eqxs.PathRules([(r"\['a'\]", P("x"))], default=Space.Host)
    with pytest.raises(TypeError, match=r"^in_specs\[0\] \(its default\): "):
        eqxs.filter_shard_map(
            lambda t: t, mesh=mesh, in_specs=(rules,), out_specs=P("x")
        )(tree)


def _bytes_in_use() -> int:
    return sum(d.memory_stats()["bytes_in_use"] for d in jax.local_devices())


@pytest.mark.accelerator
def test_offload_to_pinned_host_and_back_on_a_chip():
    # On a chip the host space is other memory: the device's bytes in use drop by
    # the tree's bytes while it is offloaded, and come back, values bit for bit.
    mesh = chip_mesh()
    s = NamedSharding(mesh, P("x"))
    tree = {
        "w": eqxs.filter_device_put(
            jax.random.normal(jax.random.key(0), (1024 * jax.device_count(), 4096)), s
        ),
        "b": eqxs.filter_device_put(jnp.arange(4096, dtype=jnp.bfloat16), s),
        "name": "a non-array leaf",
    }
    nbytes = sum(x.nbytes for x in jtu.tree_leaves(eqx.filter(tree, eqx.is_array)))
    before = _host_copy(tree)
    on_device = _bytes_in_use()
    host = eqxs.filter_device_put(tree, Space.Host)
    _assert_moved(host, tree, Space.Host)
    assert host["name"] is tree["name"]
    del tree
    jax.block_until_ready(host)
    # The tree's bytes (16 MiB a device) left the chip; the allocator's rounding is
    # far below the 1 MiB allowed.
    assert on_device - _bytes_in_use() >= nbytes - 2**20, (on_device, nbytes)
    back = eqxs.filter_device_put(host, Space.Device)
    _assert_moved(back, host, Space.Device)
    assert _bytes_in_use() - (on_device - nbytes) >= nbytes - 2**20
    for name in ("w", "b"):
        assert np.array_equal(
            np.asarray(back[name]).view(np.uint8), before[name].view(np.uint8)
        )
