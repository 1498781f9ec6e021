"""`filter_device_put` and `filter_shard`: eagerly, inside `jax.jit` and
`eqx.filter_jit`, under `jax.vmap`, `jax.grad`, `jax.eval_shape` and
`jax.disable_jit()`, on real models and optimiser states."""

import contextlib

import equinox as eqx
import equinox_shard as eqxs
import jax
import jax.numpy as jnp
import jax.random as jr
import jaxtyping
import numpy as np
import optax
import pytest
from jax.sharding import make_single_device_sharding, NamedSharding, PartitionSpec as P

from .helpers import (
    assert_alive,
    assert_array_shardings,
    assert_same_values,
    assert_shardings,
    auto_mesh,
    count_compiles,
    explicit_mesh,
    grid_shape,
    make_module,
    mixed_mesh,
    nth_device,
    snapshot,
    tree_allclose,
)


@pytest.mark.devices(8)
def test_devices():
    assert len(jax.devices()) == 8


@pytest.fixture
def device_puts(monkeypatch):
    """Records the leaves of every call to `jax.device_put`."""
    calls = []
    original = jax.device_put

    def device_put(x, *args, **kwargs):
        calls.append(x)
        return original(x, *args, **kwargs)

    monkeypatch.setattr(jax, "device_put", device_put)
    return calls


def _primitives(fun, *args):
    return [e.primitive.name for e in jax.make_jaxpr(fun)(*args).eqns]


def _jit_output_sharding(fun, *args):
    return jax.jit(fun).lower(*args).compile().output_shardings


#
# `filter_device_put`, eagerly.
#


def test_filter_device_put_is_one_batched_device_put(device_puts):
    mesh = auto_mesh()
    s = NamedSharding(mesh, P("x"))
    placed = jax.device_put(jnp.arange(8.0), s)
    device_puts.clear()
    x = {
        "a": jnp.arange(16.0),
        "b": [np.arange(24.0, dtype=np.float32), placed, 2.0],
        "c": jnp.ones((8, 2)),
    }
    expected = snapshot(x)
    out = eqxs.filter_device_put(x, s)
    # One call, with exactly the three leaves that have to move.
    assert len(device_puts) == 1
    assert len(device_puts[0]) == 3
    assert all(any(y is z for z in device_puts[0]) for y in (x["a"], x["c"]))
    assert out["b"][1] is placed
    assert out["b"][2] is x["b"][2]
    assert_shardings(out, s)
    assert_same_values(out, expected)


@pytest.mark.parametrize("function", [eqxs.filter_device_put, eqxs.filter_shard])
def test_already_placed_is_the_same_object(function, device_puts):
    mesh = auto_mesh(grid_shape(), ("data", "model"))
    device = nth_device(3)
    x = {
        "same": jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("data"))),
        "equivalent": jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P())),
        "device": jax.device_put(jnp.arange(4.0), device),
        "single": jax.device_put(jnp.arange(4.0), device),
        "key": jax.device_put(
            jr.split(jr.key(0), 8), NamedSharding(mesh, P(("data", "model")))
        ),
    }
    device_puts.clear()
    # Fresh objects, equal or merely equivalent to the arrays' own shardings.
    spec = {
        "same": NamedSharding(mesh, P("data")),
        "equivalent": NamedSharding(mesh, P(None, None)),
        "device": device,
        "single": make_single_device_sharding(device),
        "key": NamedSharding(mesh, P(("data", "model"))),
    }
    out = function(x, spec)
    for name in x:
        assert out[name] is x[name], name
    # At most the key array is handed to `jax.device_put` (which returns it as is).
    assert all(len(c) == 1 and c[0] is x["key"] for c in device_puts), device_puts
    assert_alive(x)


@pytest.mark.parametrize("function", [eqxs.filter_device_put, eqxs.filter_shard])
def test_equivalent_but_other_mesh_is_moved(function):
    # Equivalent layouts over a mesh with other axis types or names are not the same
    # type: the array is transferred, as `jax.device_put` does.
    auto = auto_mesh()
    placed = jax.device_put(jnp.arange(16.0), NamedSharding(auto, P("x")))
    for target in [
        NamedSharding(explicit_mesh(), P("x")),
        NamedSharding(auto_mesh(names=("y",)), P("y")),
    ]:
        out = function(placed, target)
        assert out is not placed
        assert out.sharding == target
        assert jax.typeof(out) == jax.typeof(jax.device_put(placed, target))
        assert_same_values(out, placed)


def test_uncommitted_is_committed(device_puts):
    device = jax.devices()[0]
    x = jnp.arange(8.0)
    assert not x.committed
    out = eqxs.filter_device_put(x, device)
    assert out.committed
    assert_shardings(out, make_single_device_sharding(device))
    assert len(device_puts) == 1
    assert_same_values(out, x)


def test_may_alias_false_copies():
    mesh = auto_mesh()
    s = NamedSharding(mesh, P("x"))
    x = {"a": jax.device_put(jnp.arange(16.0), s), "b": 3}
    out = eqxs.filter_device_put(x, s, may_alias=False)
    assert out["a"] is not x["a"]
    assert out["b"] is x["b"]
    old = {b.device: b.data.unsafe_buffer_pointer() for b in x["a"].addressable_shards}
    new = {
        b.device: b.data.unsafe_buffer_pointer() for b in out["a"].addressable_shards
    }
    assert all(old[d] != new[d] for d in old)
    assert_shardings(out, s)
    assert_same_values(out, x)
    assert_alive(x)
    # A prefix: only `a` copied.
    y = {"a": x["a"], "c": x["a"] + 1}
    out = eqxs.filter_device_put(y, s, may_alias={"a": False, "c": None})
    assert out["a"] is not y["a"]
    assert out["c"] is y["c"]


@pytest.mark.parametrize(
    "donate", [True, False, {"a": True, "b": False}, {"a": [True, False], "b": None}]
)
def test_donate_flag_and_prefix(donate):
    mesh = auto_mesh()
    s = NamedSharding(mesh, P("x"))
    x = {"a": [np.arange(8.0, dtype=np.float32), jnp.arange(16.0)], "b": jnp.ones(8)}
    expected = snapshot(x)
    out = eqxs.filter_device_put(x, s, donate=donate)
    assert_shardings(out, s)
    assert_same_values(out, expected)


def test_donate_errors():
    x = {"a": jnp.arange(8.0), "b": jnp.arange(8.0)}
    device = nth_device(1)
    with pytest.raises(ValueError, match=r"x\['b'\]"):
        eqxs.filter_device_put(x, device, donate={"a": True})
    with pytest.raises(TypeError, match="donate"):
        eqxs.filter_device_put(x, device, donate={"a": True, "b": "yes"})
    # The first mismatch is named, below bools as well as below spec leaves.
    y = {"a": [jnp.arange(8.0), jnp.arange(8.0)], "b": (jnp.arange(8.0),)}
    with pytest.raises(ValueError, match=r"x\['b'\] the specification has a list"):
        eqxs.filter_device_put(y, device, donate={"a": True, "b": [True]})
    assert_alive(x)
    assert_alive(y)
    assert not x["a"].committed


def test_donate_errors_without_the_type_checker(monkeypatch):
    # What a user without jaxtyping's checks sees (the suite's checks raise first).
    monkeypatch.setattr(jaxtyping.config, "jaxtyping_disable", True)
    x = {"a": jnp.arange(8.0), "b": jnp.arange(8.0)}
    for name in ("donate", "may_alias"):
        with pytest.raises(TypeError) as info:
            eqxs.filter_device_put(
                x, jax.devices()[1], **{name: {"a": True, "b": "yes"}}
            )
        assert str(info.value) == (
            f"`{name}` must be a bool or a PyTree prefix of `x` with bool leaves; "
            "got a leaf 'yes'."
        )
    assert_alive(x)


def test_filter_device_put_does_not_compile():
    mesh = auto_mesh(grid_shape(), ("data", "model"))
    # Shapes used nowhere else, so that nothing could come from a cache.
    committed = jax.device_put(jnp.ones((24, 6)), NamedSharding(mesh, P()))
    placed = jax.device_put(jnp.ones((24, 2)), NamedSharding(mesh, P("data", "model")))
    on_device = jax.device_put(jnp.ones((3, 5)), nth_device(2))
    x = {
        "numpy": np.ones((40, 6), dtype=np.float32),
        "committed": committed,
        "placed": placed,
        "uncommitted": jnp.ones((5, 7)),
        "on_device": on_device,
    }
    expected = snapshot(x)
    spec = {
        "numpy": NamedSharding(mesh, P("data", "model")),
        "committed": NamedSharding(mesh, P("data", "model")),
        "placed": NamedSharding(mesh, P("data", "model")),
        "uncommitted": NamedSharding(mesh, P()),
        "on_device": nth_device(5),
    }
    with count_compiles() as compiles:
        out = eqxs.filter_device_put(x, spec)
        jax.block_until_ready(out)
    assert compiles == []
    assert out["placed"] is placed
    for name, sharding in spec.items():
        if isinstance(sharding, jax.Device):
            sharding = make_single_device_sharding(sharding)
        assert_shardings(out[name], sharding)
    assert_same_values(out, expected)
    # The counter does see a compilation: an eager `with_sharding_constraint`.
    with count_compiles() as compiles:
        jax.lax.with_sharding_constraint(
            jnp.ones((56, 6)), NamedSharding(mesh, P("data"))
        )
    assert compiles != []


def test_filter_shard_eager_does_not_compile():
    mesh = auto_mesh()
    x = [np.ones((48, 3), dtype=np.float32), jnp.ones((48, 3))]
    x[1] = jax.device_put(x[1], NamedSharding(mesh, P()))
    with count_compiles() as compiles:
        out = eqxs.filter_shard(x, NamedSharding(mesh, P("x")))
        jax.block_until_ready(out)
    assert compiles == []
    assert_shardings(out, NamedSharding(mesh, P("x")))
    assert_same_values(out, x)


def test_filter_device_put_inside_jit_is_device_put():
    mesh = auto_mesh()
    s = NamedSharding(mesh, P("x"))

    def f(x):
        return eqxs.filter_device_put(x, {"a": s, "b": None})

    x = {"a": jnp.arange(16.0), "b": jnp.arange(8.0)}
    primitives = _primitives(f, x)
    # `jax.device_put` on the tracer (documented: not a constraint on Auto axes).
    assert primitives == ["device_put"]
    assert_same_values(jax.jit(f)(x), x)


def test_filter_device_put_inside_jit_explicit_changes_the_type():
    mesh = explicit_mesh()
    s = NamedSharding(mesh, P("x"))

    @jax.jit
    def f(x):
        y = eqxs.filter_device_put(x, s)
        assert jax.typeof(y).sharding.spec == P("x")
        return y * 2

    x = jax.device_put(jnp.arange(16.0), NamedSharding(mesh, P()))
    out = f(x)
    assert_shardings(out, s)
    np.testing.assert_array_equal(out, 2 * np.arange(16.0))


@pytest.mark.parametrize("function", [eqxs.filter_device_put, eqxs.filter_shard])
def test_bare_partition_spec_for_constants_inside_jit(function):
    # Inside `jax.jit` only the abstract mesh is available, also for constants.
    mesh = explicit_mesh()
    constant = np.arange(16.0, dtype=np.float32)
    with jax.set_mesh(mesh):
        out = jax.jit(lambda: function(constant, P("x")) * 2)()
    assert_shardings(out, NamedSharding(mesh, P("x")))
    np.testing.assert_array_equal(out, 2 * constant)


@pytest.mark.parametrize("function", [eqxs.filter_device_put, eqxs.filter_shard])
@pytest.mark.devices(2, reason="on one device eqx.filter_shard's output is placed too")
def test_disable_jit_places(function):
    mesh = auto_mesh()
    s = NamedSharding(mesh, P("x"))

    x = {"a": jnp.arange(16.0), "b": "static"}
    expected = snapshot(x)
    with jax.disable_jit():
        out = eqx.filter_jit(lambda y: function(y, s))(x)
        out_array = jax.jit(lambda y: function(y, s))(x["a"])
    assert out["b"] is x["b"]
    assert_shardings(out, s)
    assert_shardings(out_array, s)
    assert_same_values(out, expected)
    assert_same_values(out_array, x["a"])
    # Unlike `equinox.filter_shard`, which does nothing under `disable_jit`.
    with jax.disable_jit():
        eqx_out = eqx.filter_shard(x, s)
    assert not eqx_out["a"].sharding.is_equivalent_to(s, 1)


#
# `filter_shard` inside a trace.
#


def _constrained(x, sharding):
    return eqxs.filter_shard(x * 2, sharding) + 1


def test_filter_shard_jit_auto_is_with_sharding_constraint():
    mesh = auto_mesh(grid_shape(), ("data", "model"))
    s = NamedSharding(mesh, P("data", "model"))
    x = jnp.arange(64.0).reshape(8, 8)
    assert _primitives(lambda y: _constrained(y, s), x) == [
        "mul",
        "sharding_constraint",
        "add",
    ]
    out = jax.jit(lambda y: _constrained(y, s))(x)
    assert_shardings(out, s)
    assert _jit_output_sharding(lambda y: _constrained(y, s), x).is_equivalent_to(s, 2)
    np.testing.assert_array_equal(out, 2 * np.asarray(x) + 1)


@pytest.mark.parametrize("set_mesh", [False, True])
def test_filter_shard_jit_explicit_is_reshard(set_mesh):
    mesh = explicit_mesh(grid_shape(), ("data", "model"))
    s = NamedSharding(mesh, P("data", "model"))
    x = jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, P()))

    def f(y):
        y = eqxs.filter_shard(y * 2, s if not set_mesh else P("data", "model"))
        assert jax.typeof(y).sharding.spec == P("data", "model")
        return y + 1

    with jax.set_mesh(mesh) if set_mesh else contextlib.nullcontext():
        assert "reshard" in _primitives(f, x)
        assert "sharding_constraint" not in _primitives(f, x)
        out = jax.jit(f)(x)
        assert _jit_output_sharding(f, x).is_equivalent_to(s, 2)
    assert_shardings(out, s)
    np.testing.assert_array_equal(out, 2 * np.asarray(x) + 1)


# Issue 50 (B1): `reshard` takes the mesh's devices from its input; these failed with
# JAX's "Length of device assignment 1 is not equal to the size of the mesh 8".
@pytest.mark.parametrize("jit", [eqx.filter_jit, eqxs.filter_jit])
@pytest.mark.parametrize("spec", [P(), P("x")])
def test_filter_shard_jit_explicit_without_mesh_context(jit, spec):
    # `jax.make_mesh`'s default (Explicit) axes, no `jax.set_mesh` and no input on the
    # mesh: inside the trace JAX learns the mesh's devices from `filter_shard` alone.
    mesh = jax.make_mesh((jax.device_count(),), ("x",))
    assert mesh.axis_types == (jax.sharding.AxisType.Explicit,)
    s = NamedSharding(mesh, spec)
    model = make_module(eqx.nn.MLP, 8, 8, 8, 2)
    expected = snapshot(model)
    x = jnp.arange(16.0)
    out_model, out = jit(lambda m, y: eqxs.filter_shard((m, y * 2), s))(model, x)
    assert out_model.activation is model.activation
    assert_array_shardings(out_model, [s] * 6)
    assert_same_values(out_model, expected)
    assert_shardings(out, s)
    np.testing.assert_array_equal(out, 2 * np.asarray(x))


@pytest.mark.devices(2, reason="on one device the move needs no reshard, so no mesh")
def test_filter_shard_eager_grad_explicit_without_mesh_context_raises_as_reshard():
    # docs/troubleshooting.md: differentiating an eager `jax.grad` through the move
    # needs `jax.set_mesh`, as plain `reshard` does; with it, both work.
    mesh = jax.make_mesh((jax.device_count(),), ("x",))
    s = NamedSharding(mesh, P("x"))
    x = jnp.arange(16.0)
    ours = jax.grad(lambda y: jnp.sum(eqxs.filter_shard(y, s) ** 2))
    plain = jax.grad(lambda y: jnp.sum(jax.sharding.reshard(y, s) ** 2))
    for grad in (ours, plain):
        with pytest.raises(ValueError, match="jax.set_mesh"):
            grad(x)
    with jax.set_mesh(mesh):
        out, expected = ours(x), plain(x)
    np.testing.assert_array_equal(np.asarray(out), 2 * np.arange(16.0))
    assert out.sharding.is_equivalent_to(expected.sharding, 1)


def test_eqx_filter_shard_fails_on_explicit_mesh_where_ours_works():
    mesh = explicit_mesh()
    s = NamedSharding(mesh, P("x"))
    x = jax.device_put(jnp.arange(16.0), NamedSharding(mesh, P()))
    with pytest.raises(ValueError, match="reshard"):
        eqx.filter_jit(lambda y: eqx.filter_shard(y, s))(x)
    out = eqx.filter_jit(lambda y: eqxs.filter_shard(y, s))(x)
    assert_shardings(out, s)
    assert_same_values(out, x)


@pytest.mark.parametrize("make_mesh", [auto_mesh, explicit_mesh])
def test_filter_shard_inside_filter_jit_module(make_mesh):
    mesh = make_mesh(grid_shape(), ("data", "model"))
    model = make_module(eqx.nn.MLP, 8, 4, 16, 2)
    expected = snapshot(model)
    spec = lambda x: P("data", "model") if x.ndim == 2 else P()

    @eqx.filter_jit
    def f(m, y):
        m = eqxs.filter_shard(m, spec)
        y = eqxs.filter_shard(y * 2, P("data"))
        return m, y

    x = jnp.ones((8, 8))
    with jax.set_mesh(mesh):
        out_model, out = f(model, x)
    assert out_model.activation is model.activation
    assert out_model.final_activation is model.final_activation
    weight = NamedSharding(mesh, P("data", "model"))
    bias = NamedSharding(mesh, P())
    assert_array_shardings(out_model, [weight, bias] * 3)
    assert_same_values(out_model, expected)
    assert_shardings(out, NamedSharding(mesh, P("data")))
    np.testing.assert_array_equal(out, 2 * np.asarray(x))


def test_filter_shard_constants_inside_jit():
    # Arrays closed over by the jitted function are not tracers, but are constrained
    # all the same (`jax.device_put` there would not be a constraint).
    mesh = auto_mesh()
    constant = np.arange(16.0, dtype=np.float32)

    def f():
        return eqxs.filter_shard(constant, P("x")) + 1

    with jax.set_mesh(mesh):
        assert "sharding_constraint" in _primitives(f)
        out = jax.jit(f)()
    assert_shardings(out, NamedSharding(mesh, P("x")))
    np.testing.assert_array_equal(out, constant + 1)


@pytest.mark.parametrize("spmd_axis_name", [None, "data"])
def test_filter_shard_vmap(spmd_axis_name):
    mesh = auto_mesh(grid_shape(), ("data", "model"))

    def f(row):
        return eqxs.filter_shard(row, NamedSharding(mesh, P("model")))

    x = jnp.arange(64.0).reshape(8, 8)
    out = jax.jit(jax.vmap(f, spmd_axis_name=spmd_axis_name))(x)
    assert_shardings(out, NamedSharding(mesh, P(spmd_axis_name, "model")))
    assert_same_values(out, x)
    # Eagerly, too: `vmap` traces even outside `jit`.
    out = jax.vmap(f, spmd_axis_name=spmd_axis_name)(x)
    assert_shardings(out, NamedSharding(mesh, P(spmd_axis_name, "model")))
    assert_same_values(out, x)


def test_filter_shard_vmap_explicit():
    mesh = explicit_mesh(grid_shape(), ("data", "model"))
    x = jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("data")))
    with jax.set_mesh(mesh):
        out = jax.jit(jax.vmap(lambda row: eqxs.filter_shard(row, P("model"))))(x)
    # The batch axis keeps the input's sharding (it is in the type).
    assert_shardings(out, NamedSharding(mesh, P("data", "model")))
    assert_same_values(out, x)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("make_mesh", [auto_mesh, explicit_mesh])
def test_filter_shard_grad(jit, make_mesh):
    mesh = make_mesh(grid_shape(), ("data", "model"))
    s = NamedSharding(mesh, P("data", "model"))

    def loss(w, n):
        w = eqxs.filter_shard({"w": w, "n": n}, s)["w"]
        return jnp.sum(w**2)

    grad = jax.grad(loss)
    if jit:
        grad = jax.jit(grad, static_argnums=1)
    x = jnp.arange(64.0).reshape(8, 8)
    if make_mesh is explicit_mesh:
        # In Explicit mode the cotangent takes the primal input's sharding.
        x = jax.device_put(x, s)
    with jax.set_mesh(mesh):
        out = grad(x, 3)
    assert_shardings(out, s)
    np.testing.assert_array_equal(out, 2 * np.asarray(x))


@pytest.mark.parametrize("make_mesh", [auto_mesh, explicit_mesh])
def test_filter_shard_eval_shape(make_mesh):
    mesh = make_mesh(grid_shape(), ("data", "model"))
    s = NamedSharding(mesh, P("data"))
    x = {"a": jnp.ones((8, 2)), "f": jnp.tanh}
    with jax.set_mesh(mesh):
        out = eqx.filter_eval_shape(lambda y: eqxs.filter_shard(y, s), x)
    assert out["f"] is jnp.tanh
    assert isinstance(out["a"], jax.ShapeDtypeStruct)
    assert out["a"].shape == (8, 2)
    assert out["a"].dtype == jnp.float32
    if make_mesh is explicit_mesh:
        assert out["a"].sharding.spec == P("data", None)
    # `jax.eval_shape` as well.
    shape = jax.eval_shape(lambda y: eqxs.filter_shard(y, s), x["a"])
    assert shape.shape == (8, 2)


@pytest.mark.cpu(reason="memory kinds other than device behave otherwise on a chip")
def test_filter_shard_pinned_host_inside_jit():
    mesh = auto_mesh()
    s = NamedSharding(mesh, P("x"), memory_kind="pinned_host")

    def f(x):
        return eqxs.filter_shard(x * 2, s)

    x = jnp.arange(16.0)
    # The layout is constrained, then the memory kind set.
    assert _primitives(f, x) == ["mul", "sharding_constraint", "device_put"]
    out = jax.jit(f)(x)
    assert out.sharding.memory_kind == "pinned_host"
    assert_shardings(out, s)
    np.testing.assert_array_equal(out, 2 * np.arange(16.0))
    # And eagerly.
    out = eqxs.filter_shard(x, s)
    assert out.sharding.memory_kind == "pinned_host"
    assert_shardings(out, s)
    assert eqxs.filter_shard(out, s) is out
    assert_same_values(out, x)


def test_mesh_with_both_axis_types_one_kind_per_spec():
    mesh = mixed_mesh()
    x = jnp.arange(64.0).reshape(8, 8)
    explicit_only = lambda y: eqxs.filter_shard(y, P("data"))
    auto_only = lambda y: eqxs.filter_shard(y, P(None, "model"))
    with jax.set_mesh(mesh):
        assert _primitives(explicit_only, x) == ["reshard"]
        assert _primitives(auto_only, x) == ["sharding_constraint"]
        out_explicit = jax.jit(explicit_only)(x)
        out_auto = jax.jit(auto_only)(x)
    assert_shardings(out_explicit, NamedSharding(mesh, P("data")))
    assert_shardings(out_auto, NamedSharding(mesh, P(None, "model")))
    assert_same_values(out_explicit, x)
    assert_same_values(out_auto, x)


#
# Real models and state.
#


def _rule(leaf):
    """Shard axis 0 over 'data' when divisible, else replicate."""
    if leaf.ndim > 0 and leaf.shape[0] % 4 == 0:
        return P("data")
    return P()


def _expected_rule(mesh, tree):
    return [
        NamedSharding(mesh, _rule(x)) for x in jax.tree.leaves(tree) if eqx.is_array(x)
    ]


@pytest.mark.parametrize("make_mesh", [auto_mesh, explicit_mesh])
@pytest.mark.parametrize("jit", [False, True])
def test_models_and_state(make_mesh, jit):
    mesh = make_mesh(grid_shape(), ("data", "model"))
    mlp = make_module(eqx.nn.MLP, 8, 4, 16, 2)
    linear = make_module(eqx.nn.Linear, 16, 16, use_bias=False)
    batch_norm, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(
        16, "batch", mode="batch"
    )
    opt_state = optax.adam(1e-3).init(eqx.filter(mlp, eqx.is_array))
    keys = jr.split(jr.key(0), 64)
    tree = {
        "mlp": mlp,
        "linear": linear,
        "bn": (batch_norm, state),
        "opt": opt_state,
        "keys": keys,
        "numpy": np.arange(12, dtype=np.int32),
    }
    expected = snapshot(tree)
    place = lambda t: eqxs.filter_shard(t, _rule)
    with jax.set_mesh(mesh):
        out = eqx.filter_jit(place)(tree) if jit else place(tree)
    assert out["linear"].bias is None
    assert out["mlp"].activation is mlp.activation
    assert out["bn"][0].axis_name == "batch"
    assert isinstance(out["bn"][1], eqx.nn.State)
    assert_array_shardings(out, _expected_rule(mesh, tree))
    # (`is_equivalent_to`: on one device `jax.jit` may name the output's spec P().)
    assert out["keys"].sharding.is_equivalent_to(NamedSharding(mesh, P("data")), 1)
    assert_same_values(out, expected)
    # The placed state is still read through the module's own `StateIndex`.
    running_mean, _ = out["bn"][1].get(out["bn"][0].batch_state_index)
    assert_shardings(running_mean, NamedSharding(mesh, P("data")))
    # Placing again is a no-op.
    # Placing again is a no-op: every leaf is the same object.
    with jax.set_mesh(mesh):
        again = eqxs.filter_device_put(out, _rule)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(out)):
        assert a is b


def test_prng_keys_over_2d_mesh():
    mesh = auto_mesh(grid_shape(), ("data", "model"))
    s = NamedSharding(mesh, P(("data", "model")))
    keys = jr.split(jr.key(0), 64)
    out = eqxs.filter_device_put(keys, s)
    assert jnp.issubdtype(out.dtype, jax.dtypes.prng_key)
    assert_shardings(out, s)
    assert_same_values(out, keys)
    # Keys made inside `jit` can be constrained too.
    made = jax.jit(lambda k: eqxs.filter_shard(jr.split(k, 64), s))(jr.key(1))
    assert_shardings(made, s)
    assert_same_values(made, jr.split(jr.key(1), 64))


def test_optax_update_with_sharded_state():
    mesh = auto_mesh(grid_shape(), ("data", "model"))
    spec = lambda x: P("data") if x.ndim == 2 else P()
    optimiser = optax.adam(1e-2)
    params = eqx.filter(make_module(eqx.nn.MLP, 8, 4, 16, 2), eqx.is_array)

    def step(params, opt_state):
        grads = jax.tree.map(jnp.ones_like, params)
        updates, opt_state = optimiser.update(grads, opt_state, params)
        return eqx.apply_updates(params, updates), opt_state

    # optax's bias correction computes `float ** int32`, which strict promotion rejects.
    with jax.numpy_dtype_promotion("standard"), jax.set_mesh(mesh):
        reference = eqx.filter_jit(step)(params, optimiser.init(params))
        sharded_params = eqxs.filter_device_put(params, spec)
        opt_state = eqxs.filter_device_put(optimiser.init(sharded_params), spec)
        out = eqx.filter_jit(lambda p, s: eqxs.filter_shard(step(p, s), spec))(
            sharded_params, opt_state
        )
    for leaf in jax.tree.leaves(opt_state) + jax.tree.leaves(out):
        assert_shardings(leaf, NamedSharding(mesh, spec(leaf)))
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(reference)):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_unconstrained_dimension_is_replicated_eagerly():
    # `eqx.filter_shard` accepts `P.UNCONSTRAINED` eagerly (an identity `jit`); a
    # transfer needs a concrete layout, so the dimension is placed replicated.
    mesh = auto_mesh()
    target = NamedSharding(mesh, P("x", P.UNCONSTRAINED))
    x = jnp.arange(64.0).reshape(8, 8)
    for out in (
        eqxs.filter_shard(x, target),
        eqxs.filter_device_put(x, target),
    ):
        assert out.sharding.is_equivalent_to(NamedSharding(mesh, P("x", None)), 2)
        assert tree_allclose(out, x)
    traced = jax.jit(lambda y: eqxs.filter_shard(y, target))(x)
    assert tree_allclose(traced, x)


class _Tied(eqx.Module):
    emb: jax.Array
    out: jax.Array


@pytest.mark.parametrize("flags", [dict(donate=True), dict(may_alias=True), {}])
@pytest.mark.parametrize("placed", [False, True])
@pytest.mark.parametrize("target", ["replicated", "device"])
def test_an_array_placed_twice_is_one_result(flags, placed, target):
    # Tied weights: two results sharing one buffer would be donated twice (XLA
    # refuses, or crashes) or freed under each other; one result, as the same object,
    # is refused by name before anything runs.
    mesh = auto_mesh()
    spec = NamedSharding(mesh, P()) if target == "replicated" else nth_device(1)
    w = jnp.arange(16.0)
    if placed:
        w = jax.device_put(w, spec)
    expected = np.arange(16.0, dtype=np.float32)
    model = eqxs.filter_device_put(_Tied(w, w), spec, **flags)
    assert model.emb is model.out
    if not flags.get("donate"):
        assert_alive(w)
    assert_same_values(model.emb, expected)
    step = eqxs.filter_jit(lambda m: _Tied(m.emb + 1, m.out * 2), donate="all")
    with pytest.raises(ValueError, match=r"^m\.emb and m\.out are the same array"):
        step(model)
    assert_alive(model.emb)
    assert_same_values(model.emb, expected)


def test_donate_and_may_alias_on_one_array_is_refused():
    x = {"a": jnp.ones(3), "b": jnp.ones(3)}
    with pytest.raises(ValueError, match=r"^x\['b'\]: `donate` and `may_alias` are"):
        eqxs.filter_device_put(
            x, nth_device(1), donate={"a": False, "b": True}, may_alias=True
        )
    assert_alive(x)
    with pytest.raises(ValueError, match=r"^x\['a'\]: `donate` and `may_alias`"):
        eqxs.filter_device_put(x, nth_device(1), donate=True, may_alias=True)
    assert_alive(x)
