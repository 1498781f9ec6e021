import re

import equinox as eqx
import equinox_shard as eqxs
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from .helpers import (
    assert_array_shardings,
    auto_mesh,
    explicit_mesh,
    make_module,
    tree_allclose,
)


MESHES = [auto_mesh, explicit_mesh]


def _context(mesh):
    # Explicit axes need the mesh set (JAX's rule for computations on them).
    return jax.set_mesh(mesh)


@pytest.mark.parametrize("make_mesh", MESHES)
@pytest.mark.devices(8, reason="shard shapes written out for 8 devices")
def test_linear_row_parallel_psum(make_mesh):
    mesh = make_mesh()
    linear = make_module(eqx.nn.Linear, 16, 32)
    x = jnp.arange(16, dtype=jnp.float32)

    columns = lambda a: P(None, "x") if a.ndim == 2 else P()  # the weight, not the bias

    @eqxs.filter_shard_map(mesh=mesh, in_specs=(columns, P("x")), out_specs=P())
    def row_parallel(linear, x):
        # `linear.weight` is the (32, 2) block of one device; `x` its 2 features.
        assert linear.weight.shape == (32, 2)
        return jax.lax.psum(linear.weight @ x, "x") + linear.bias

    with _context(mesh):
        y = row_parallel(linear, x)
    np.testing.assert_allclose(y, linear(x), rtol=1e-5, atol=1e-5)
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, P()), 1)


@pytest.mark.parametrize("make_mesh", MESHES)
def test_mlp_data_parallel_outputs_module_and_non_arrays(make_mesh):
    mesh = make_mesh()
    mlp = make_module(eqx.nn.MLP, 4, 3, 8, 2)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((16, 4)), jnp.float32)

    def f(mlp, x, name):
        return {"y": jax.vmap(mlp)(x), "model": mlp, "name": name + "!"}

    mapped = eqxs.filter_shard_map(
        f,
        mesh=mesh,
        in_specs=(P(), P("x"), None),
        out_specs={"y": P("x"), "model": P(), "name": None},
    )
    with _context(mesh):
        out = mapped(mlp, x, "mlp")
    assert tree_allclose(out["y"], jax.vmap(mlp)(x), rtol=1e-5, atol=1e-6)
    assert out["name"] == "mlp!"
    # Non-array leaves come back as the very same objects.
    assert out["model"].activation is mlp.activation
    assert out["model"].final_activation is mlp.final_activation
    assert tree_allclose(out["model"], mlp)
    replicated = NamedSharding(mesh, P())
    assert_array_shardings(out, [replicated] * 6 + [NamedSharding(mesh, P("x"))])


def test_every_array_leaf_sharded_as_out_specs():
    mesh = auto_mesh((4, 2), ("data", "model"))
    rng = np.random.default_rng(1)
    norm = eqx.nn.LayerNorm(16)
    norm = eqx.tree_at(
        lambda n: (n.weight, n.bias),
        norm,
        tuple(jnp.asarray(rng.standard_normal(16), jnp.float32) for _ in range(2)),
    )
    x = jnp.asarray(rng.standard_normal((8, 16)), jnp.float32)

    # Each device normalises its rows and returns its block of the weight.
    @eqxs.filter_shard_map(
        mesh=mesh,
        in_specs=(P("model"), P("data")),
        out_specs=(P("data"), P("model"), P("model")),
        check_vma=False,  # `all_gather`'s result is typed as varying over "model".
    )
    def f(norm, x):
        full = jax.tree.map(
            lambda w: jax.lax.all_gather(w, "model", tiled=True),
            eqx.filter(norm, eqx.is_array),
        )
        full = eqx.combine(full, norm)
        return jax.vmap(full)(x), norm.weight, norm.bias

    y, weight, bias = f(norm, x)
    np.testing.assert_allclose(y, jax.vmap(norm)(x), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(weight, norm.weight)
    np.testing.assert_array_equal(bias, norm.bias)
    assert_array_shardings(
        (y, weight, bias),
        [
            NamedSharding(mesh, P("data")),
            NamedSharding(mesh, P("model")),
            NamedSharding(mesh, P("model")),
        ],
    )


@pytest.mark.parametrize("make_mesh", MESHES)
@pytest.mark.devices(8, reason="shard shapes written out for 8 devices")
def test_multihead_attention_heads_split(make_mesh):
    # Tensor parallel attention: every device holds the query/key/value projections
    # of 1 head (of 8) and the matching columns of the output projection.
    mesh = make_mesh()
    attention = make_module(eqx.nn.MultiheadAttention, 8, 32)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((5, 32)), jnp.float32)
    split = eqx.tree_at(
        lambda a: (
            a.query_proj.weight,
            a.key_proj.weight,
            a.value_proj.weight,
            a.output_proj.weight,
        ),
        jtu.tree_map(lambda _: None, attention),
        (P("x", None), P("x", None), P("x", None), P(None, "x")),
        is_leaf=lambda x: x is None,
    )

    @eqxs.filter_shard_map(mesh=mesh, in_specs=(split, P()), out_specs=P())
    def f(attention, x):
        # One head per device: query/key/value weights (4, 32), output weight (32, 4).
        assert attention.query_proj.weight.shape == (4, 32)
        assert attention.output_proj.weight.shape == (32, 4)
        q = jax.vmap(attention.query_proj)(x)
        k = jax.vmap(attention.key_proj)(x)
        v = jax.vmap(attention.value_proj)(x)
        weights = jax.nn.softmax(q @ k.T / jnp.sqrt(4.0), axis=-1)
        heads = weights @ v
        # The output projection is row-parallel: sum the heads' contributions.
        return jax.lax.psum(heads @ attention.output_proj.weight.T, "x")

    with _context(mesh):
        y = f(attention, x)
    # The reference (no output bias: `use_output_bias=False` is the default).
    expected = attention(x, x, x)
    np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-5)


def test_none_in_specs_passes_the_array_whole():
    mesh = auto_mesh()
    x = jnp.arange(16.0)
    table = jnp.arange(3.0)
    seen = []

    def f(x, table):
        seen.append(table.shape)
        return x + table.sum()

    y = eqxs.filter_shard_map(f, mesh=mesh, in_specs=(P("x"), None), out_specs=P("x"))(
        x, table
    )
    np.testing.assert_array_equal(y, x + 3.0)
    assert seen == [(3,)]  # not split


def test_none_over_array_output_is_an_error():
    mesh = auto_mesh()
    f = eqxs.filter_shard_map(
        lambda x: (x, x), mesh=mesh, in_specs=P("x"), out_specs=(P("x"), None)
    )
    with pytest.raises(ValueError, match=r"out\[1\]: an array output needs"):
        f(jnp.arange(8.0))


@pytest.mark.parametrize("make_mesh", MESHES)
@pytest.mark.devices(8, reason="shard shapes written out for 8 devices")
def test_inside_filter_jit_and_grad(make_mesh):
    mesh = make_mesh()
    mlp = make_module(eqx.nn.MLP, 4, 1, 8, 1)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((16, 4)), jnp.float32)

    def loss(mlp, x):
        # Data parallel: each device's mean squared output, averaged with a psum.
        @eqxs.filter_shard_map(mesh=mesh, in_specs=(P(), P("x")), out_specs=P())
        def local(mlp, x):
            return jax.lax.psum(jnp.mean(jax.vmap(mlp)(x) ** 2), "x") / 8

        return local(mlp, x)

    def reference(mlp, x):
        return jnp.mean(jax.vmap(mlp)(x) ** 2)

    with _context(mesh):
        value, grads = eqxs.filter_jit(eqx.filter_value_and_grad(loss))(mlp, x)
        eager_grads = eqx.filter_grad(loss)(mlp, x)
    ref_value, ref_grads = eqx.filter_value_and_grad(reference)(mlp, x)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    assert tree_allclose(grads, ref_grads, rtol=1e-4, atol=1e-6)
    assert tree_allclose(eager_grads, ref_grads, rtol=1e-4, atol=1e-6)


@pytest.mark.devices(8, reason="a ppermute written out over 8 devices")
def test_all_gather_and_ppermute_on_weights():
    mesh = auto_mesh()
    linear = make_module(eqx.nn.Linear, 4, 16)

    # `all_gather`'s result is the same on every device, but is typed as varying:
    # `check_vma=False` lets its out_spec be `P()`.
    @eqxs.filter_shard_map(
        mesh=mesh, in_specs=P("x"), out_specs=(P(), P("x")), check_vma=False
    )
    def f(linear):
        gathered = jax.lax.all_gather(linear.weight, "x", tiled=True)
        # Rotate each device's rows of the bias to the next device.
        shifted = jax.lax.ppermute(
            linear.bias, "x", perm=[(i, (i + 1) % 8) for i in range(8)]
        )
        return gathered, shifted

    gathered, shifted = f(linear)
    np.testing.assert_array_equal(gathered, linear.weight)
    np.testing.assert_array_equal(shifted, jnp.roll(linear.bias, 2))
    assert_array_shardings(
        (gathered, shifted),
        [NamedSharding(mesh, P()), NamedSharding(mesh, P("x"))],
    )


@pytest.mark.devices(8, reason="shard shapes written out for 8 devices")
def test_mesh_from_set_mesh_and_callable_spec():
    mesh = auto_mesh()
    mlp = make_module(eqx.nn.MLP, 3, 8, 16, 1)
    split_rows = lambda x: P("x") if x.shape[0] % 8 == 0 else P()
    seen = []

    def f(mlp):
        seen.extend(x.shape for x in jtu.tree_leaves(eqx.filter(mlp, eqx.is_array)))
        return mlp

    with jax.set_mesh(mesh):
        # A callable in `out_specs` sees the block that `f` returns, so it is not
        # reused here: the (1, 16) block of the second weight would not divide.
        out = eqxs.filter_shard_map(f, in_specs=split_rows, out_specs=P("x"))(mlp)
    # weight (16, 3) and bias (16,) split; weight (8, 16) and bias (8,) split too.
    assert seen == [(2, 3), (2,), (1, 16), (1,)]
    assert tree_allclose(out, mlp)
    assert_array_shardings(out, [NamedSharding(mesh, P("x"))] * 4)


@pytest.mark.devices(8, reason="shard shapes written out for 8 devices")
def test_path_rules_as_in_specs():
    mesh = auto_mesh()
    mlp = make_module(eqx.nn.MLP, 4, 8, 16, 1)
    rules = eqxs.PathRules([(r"layers\[0\]", P("x"))], default=P())
    seen = []

    def f(mlp):
        seen.extend(x.shape for x in jtu.tree_leaves(eqx.filter(mlp, eqx.is_array)))
        return mlp

    out = eqxs.filter_shard_map(f, mesh=mesh, in_specs=rules, out_specs=rules)(mlp)
    assert seen == [(2, 4), (2,), (8, 16), (8,)]
    assert tree_allclose(out, mlp)
    assert_array_shardings(
        out,
        [NamedSharding(mesh, P("x"))] * 2 + [NamedSharding(mesh, P())] * 2,
    )


def test_kwargs_are_passed_whole():
    mesh = auto_mesh()
    f = eqxs.filter_shard_map(
        lambda x, *, scale: x * scale.sum(),
        mesh=mesh,
        in_specs=P("x"),
        out_specs=P("x"),
    )
    y = f(jnp.arange(8.0), scale=jnp.ones(3))
    np.testing.assert_array_equal(y, jnp.arange(8.0) * 3)


def test_matches_jax_shard_map_on_the_partition():
    mesh = auto_mesh()
    mlp = make_module(eqx.nn.MLP, 4, 2, 8, 1)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((16, 4)), jnp.float32)

    def f(mlp, x):
        return jax.lax.pmean(jax.vmap(mlp)(x).sum(), "x")

    ours = eqxs.filter_shard_map(f, mesh=mesh, in_specs=(P(), P("x")), out_specs=P())
    params, static = eqx.partition(mlp, eqx.is_array)
    theirs = jax.shard_map(
        lambda p, x: f(eqx.combine(p, static), x),
        mesh=mesh,
        in_specs=(P(), P("x")),
        out_specs=P(),
    )
    np.testing.assert_array_equal(ours(mlp, x), theirs(params, x))


#
# Errors name the user's key path.
#


@pytest.mark.devices(8, reason="a dimension size that 8 devices do not divide")
def test_error_indivisible_names_path():
    mesh = auto_mesh()
    mlp = make_module(eqx.nn.MLP, 4, 3, 8, 1)
    f = eqxs.filter_shard_map(lambda m: m, mesh=mesh, in_specs=P("x"), out_specs=P())
    with pytest.raises(
        ValueError, match=r"args\[0\]\.layers\[1\]\.weight: dimension 0"
    ):
        f(mlp)


def test_error_not_a_prefix_names_path():
    mesh = auto_mesh()
    f = eqxs.filter_shard_map(
        lambda d: d, mesh=mesh, in_specs=({"a": P("x"), "b": P()},), out_specs=P()
    )
    with pytest.raises(
        ValueError,
        match=r"at args\[0\]\['c'\] the value has this key but the specification "
        r"does not; the specification has 'b', which the value does not",
    ):
        f({"a": jnp.zeros(8), "c": jnp.zeros(8)})


def test_error_out_specs_rank_names_path():
    mesh = auto_mesh()
    f = eqxs.filter_shard_map(
        lambda x: {"s": x.sum()}, mesh=mesh, in_specs=P("x"), out_specs=P("x")
    )
    with pytest.raises(ValueError, match=r"out\['s'\]: PartitionSpec"):
        f(jnp.arange(8.0))


def test_error_unknown_axis_and_sharding_leaf():
    mesh = auto_mesh()
    f = eqxs.filter_shard_map(lambda x: x, mesh=mesh, in_specs=P("y"), out_specs=P())
    with pytest.raises(ValueError, match=r"args\[0\]"):
        f(jnp.arange(8.0))
    with pytest.raises(TypeError, match=r"in_specs\[0\]: a `filter_shard_map`"):
        eqxs.filter_shard_map(
            lambda x: x,
            mesh=mesh,
            in_specs=(NamedSharding(mesh, P("x")),),
            out_specs=P(),
        )


def test_error_no_mesh():
    f = eqxs.filter_shard_map(lambda x: x, in_specs=P("x"), out_specs=P("x"))
    with pytest.raises(ValueError, match="needs a mesh"):
        f(jnp.arange(8.0))


def test_deleted_input_is_named_before_anything_runs():
    mesh = jax.make_mesh(
        (jax.device_count(),), ("x",), axis_types=(jax.sharding.AxisType.Auto,)
    )
    w = jax.device_put(jnp.arange(64.0), jax.NamedSharding(mesh, P("x")))
    w.delete()
    f = eqxs.filter_shard_map(
        lambda params: params, mesh=mesh, in_specs=(P("x"),), out_specs=P("x")
    )
    with pytest.raises(RuntimeError, match=r"^args\[0\]\['w'\]: this array has been"):
        f({"b": 1.0, "w": w})


class _Normed(eqx.Module):
    norm: eqx.nn.LayerNorm


@pytest.mark.parametrize("jit", [False, True])
def test_error_output_varies_under_replicated_spec_names_function_and_path(jit):
    mesh = auto_mesh()
    model = _Normed(eqx.nn.LayerNorm(4))

    def update_stats(x, model):
        # The local batch mean differs from device to device: not replicated.
        mean = jnp.mean(x)
        model = eqx.tree_at(lambda m: m.norm.weight, model, model.norm.weight + mean)
        return jax.lax.psum(jnp.sum(x), "x"), model

    f = eqxs.filter_shard_map(
        update_stats, mesh=mesh, in_specs=(P("x"), P()), out_specs=(P(), P())
    )
    if jit:
        f = eqxs.filter_jit(f)
    with pytest.raises(ValueError) as caught:
        f(jnp.arange(16.0), model)
    msg = str(caught.value)
    assert "update_stats" in msg and "_rem_singleton" not in msg
    assert re.search(r"^- out\[1\]\.norm\.weight: ", msg, re.MULTILINE), msg
    assert "out[0]" not in msg and "norm.bias" not in msg  # those are replicated
    assert "check_vma=False" in msg
    assert isinstance(caught.value.__cause__, ValueError)  # JAX's own
