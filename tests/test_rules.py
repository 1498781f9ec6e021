import re
from typing import Any

import equinox as eqx
import equinox_shard as eqxs
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import jaxtyping
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from .helpers import (
    assert_array_shardings,
    auto_mesh,
    explicit_mesh,
    grid_shape,
    make_module,
    nth_device,
    tree_allclose,
)


# Megatron-style tensor parallelism for an MLP with two hidden layers of width 16.
TENSOR = eqxs.PathRules(
    [
        (r"layers\[0\]\.weight$", P("model", None)),
        (r"layers\[0\]\.bias$", P("model")),
        (r"layers\[1\]\.weight$", P(None, "model")),
    ],
    default=P(),
)


def _mesh(make_mesh=auto_mesh):
    return make_mesh(grid_shape(), ("data", "model"))


def _expected_mlp(mesh):
    # layers[0].weight, layers[0].bias, layers[1].weight, layers[1].bias
    return [
        NamedSharding(mesh, P("model", None)),
        NamedSharding(mesh, P("model")),
        NamedSharding(mesh, P(None, "model")),
        NamedSharding(mesh, P()),
    ]


def test_filter_device_put_mlp():
    mesh = _mesh()
    mlp = make_module(eqx.nn.MLP, 8, 4, 16, 1)
    with jax.set_mesh(mesh):
        out = eqxs.filter_device_put(mlp, TENSOR)
    assert_array_shardings(out, _expected_mlp(mesh))
    assert tree_allclose(out, mlp)
    assert out.activation is mlp.activation


def test_adamw_state_follows_parameters():
    mesh = _mesh()
    mlp = make_module(eqx.nn.MLP, 8, 4, 16, 1)
    opt_state = optax.adamw(1e-3).init(eqx.filter(mlp, eqx.is_array))
    with jax.set_mesh(mesh):
        model, opt_state = eqxs.filter_device_put((mlp, opt_state), TENSOR)
    expected = _expected_mlp(mesh)
    assert_array_shardings(model, expected)
    # adamw: (ScaleByAdamState(count, mu, nu), EmptyState, ...): the count is a scalar
    # that falls to the default; each moment is laid out like its parameter.
    adam = opt_state[0]
    assert adam.count.sharding.is_equivalent_to(NamedSharding(mesh, P()), 0)
    assert_array_shardings(adam.mu, expected)
    assert_array_shardings(adam.nu, expected)
    paths = [jtu.keystr(p) for p, _ in jtu.tree_flatten_with_path(opt_state)[0]]
    assert paths[1] == "[0].mu.layers[0].weight"


def test_no_match_no_default_is_an_error_naming_the_path():
    mesh = _mesh()
    mlp = make_module(eqx.nn.MLP, 8, 4, 16, 1)
    rules = eqxs.PathRules([(r"weight$", P())])
    with jax.set_mesh(mesh):
        with pytest.raises(
            ValueError,
            match=re.escape(
                "x.layers[0].bias: no rule matches its key path '.layers[0].bias'"
            ),
        ):
            eqxs.filter_device_put(mlp, rules)


def test_first_match_wins_and_spec_kinds():
    mesh = _mesh()
    device = nth_device(3)
    tree = {"a": jnp.zeros(8), "b": jnp.ones(8), "c": jnp.arange(8.0), "d": np.ones(4)}
    rules = eqxs.PathRules(
        [
            (r"\['a'\]", NamedSharding(mesh, P("data"))),
            (r"\['a'\]", P()),  # never reached
            (r"\['b'\]", lambda x: P("model") if x.shape[0] % 2 == 0 else P()),
            (r"\['c'\]", device),
            (r"\['d'\]", None),  # left as it is: a NumPy array stays one
        ]
    )
    with jax.set_mesh(mesh):
        out = eqxs.filter_device_put(tree, rules)
    assert out["a"].sharding == NamedSharding(mesh, P("data"))
    assert out["b"].sharding.is_equivalent_to(NamedSharding(mesh, P("model")), 1)
    assert out["c"].sharding.device_set == {device}
    assert out["d"] is tree["d"]


def test_paths_are_relative_to_the_rules_position():
    mesh = _mesh()
    mlp = make_module(eqx.nn.MLP, 8, 4, 16, 1)
    anchored = eqxs.PathRules([(r"^\.layers\[0\]", P("model"))], default=P())
    with jax.set_mesh(mesh):
        # Covering the model alone, the path is `.layers[0].weight`: matched.
        (out,) = eqxs.filter_device_put((mlp,), (anchored,))
        assert out.layers[0].weight.sharding.spec == P("model")
        # Covering the tuple, the path is `[0].layers[0].weight`: not matched.
        (out,) = eqxs.filter_device_put((mlp,), anchored)
        assert out.layers[0].weight.sharding.spec == P()


def _double(tree):
    return jtu.tree_map(lambda x: x * 2 if eqx.is_array(x) else x, tree)


@pytest.mark.parametrize("make_mesh", [auto_mesh, explicit_mesh])
def test_filter_shard_inside_jit(make_mesh):
    mesh = _mesh(make_mesh)
    mlp = make_module(eqx.nn.MLP, 8, 4, 16, 1)

    @eqx.filter_jit
    def f(mlp):
        return eqxs.filter_shard(_double(mlp), TENSOR)

    with jax.set_mesh(mesh):
        out = f(mlp)
    assert_array_shardings(out, _expected_mlp(mesh))
    assert tree_allclose(out, _double(mlp))


# Auto axes: on Explicit ones, `eqx.nn.Linear`'s matmul over a split contracting
# dimension would need an `out_sharding` that it does not take.
@jax.numpy_dtype_promotion("standard")  # optax mixes its int32 step count with floats
def test_filter_jit_training_step():
    mesh = _mesh()
    mlp = make_module(eqx.nn.MLP, 8, 4, 16, 1)
    optim = optax.adamw(1e-2)
    opt_state = optim.init(eqx.filter(mlp, eqx.is_array))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((16, 4)), jnp.float32)

    def step(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(
            lambda m: jnp.mean((jax.vmap(m)(x) - y) ** 2)
        )(model)
        updates, opt_state = optim.update(
            grads, opt_state, eqx.filter(model, eqx.is_array)
        )
        return eqx.apply_updates(model, updates), opt_state, loss

    sharded = eqxs.filter_jit(
        step,
        in_shardings=(TENSOR, TENSOR, P("data"), P("data")),
        out_shardings=(TENSOR, TENSOR, P()),
    )
    with jax.set_mesh(mesh):
        model, state = eqxs.filter_device_put((mlp, opt_state), TENSOR)
        xs, ys = eqxs.filter_device_put((x, y), P("data"))
        model, state, loss = sharded(model, state, xs, ys)
    ref_model, ref_state, ref_loss = eqx.filter_jit(step)(mlp, opt_state, x, y)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert tree_allclose(model, ref_model, rtol=1e-5, atol=1e-6)
    assert tree_allclose(state, ref_state, rtol=1e-5, atol=1e-6)
    expected = _expected_mlp(mesh)
    assert_array_shardings(model, expected)
    state_: Any = state
    adam = state_[0]  # optax.ScaleByAdamState
    assert_array_shardings(adam.mu, expected)
    assert adam.count.sharding.is_equivalent_to(NamedSharding(mesh, P()), 0)


def test_filter_jit_single_rules_for_every_argument():
    mesh = _mesh()
    mlp = make_module(eqx.nn.MLP, 8, 4, 16, 1)
    seen = []

    @eqxs.filter_jit(in_shardings=TENSOR)
    def f(a, b):
        seen.append(1)
        return a, b

    with jax.set_mesh(mesh):
        # Paths are relative to each argument, as with `in_shardings=(TENSOR, TENSOR)`.
        a = eqxs.filter_device_put(mlp, TENSOR)
        b = eqxs.filter_device_put(mlp, TENSOR)
        out = f(a, b)
    assert_array_shardings(out, _expected_mlp(mesh) * 2)


def test_filter_jit_in_shardings_error_names_argument():
    mesh = _mesh()
    mlp = make_module(eqx.nn.MLP, 8, 4, 16, 1)
    f = eqxs.filter_jit(lambda model: model, in_shardings=eqxs.PathRules([]))
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"model\.layers\[0\]"):
        f(mlp)


def test_stacked_transformer_layers():
    # Layers stacked along a leading axis (to be run with `jax.lax.scan`): the rules
    # split the feature axes, never the stacked one.
    mesh = _mesh()

    class Block(eqx.Module):
        norm: eqx.nn.LayerNorm
        attention: eqx.nn.MultiheadAttention

        def __init__(self, key):
            self.norm = eqx.nn.LayerNorm(16)
            self.attention = eqx.nn.MultiheadAttention(4, 16, key=key)

    class Model(eqx.Module):
        embedding: eqx.nn.Embedding
        blocks: Block

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.embedding = eqx.nn.Embedding(32, 16, key=k1)
            self.blocks = eqx.filter_vmap(Block)(jax.random.split(k2, 3))

    model = Model(jax.random.key(0))
    rules = eqxs.PathRules(
        [
            (r"embedding\.weight$", P(None, "model")),
            (r"(query|key|value)_proj\.weight$", P(None, "model", None)),
            (r"output_proj\.weight$", P(None, None, "model")),
            (r"norm\.", P(None, None)),
        ]
    )
    with jax.set_mesh(mesh):
        out = eqxs.filter_device_put(model, rules)
    assert tree_allclose(out, model)
    specs = {
        jtu.keystr(p): x.sharding.spec
        for p, x in jtu.tree_leaves_with_path(out)
        if eqx.is_array(x)
    }
    assert specs == {
        ".embedding.weight": P(None, "model"),
        ".blocks.norm.weight": P(None, None),
        ".blocks.norm.bias": P(None, None),
        ".blocks.attention.query_proj.weight": P(None, "model", None),
        ".blocks.attention.key_proj.weight": P(None, "model", None),
        ".blocks.attention.value_proj.weight": P(None, "model", None),
        ".blocks.attention.output_proj.weight": P(None, None, "model"),
    }


def test_sharding_table_shows_rules():
    mesh = _mesh()
    mlp = make_module(eqx.nn.MLP, 8, 4, 16, 1)
    with jax.set_mesh(mesh):
        mlp = eqxs.filter_device_put(mlp, TENSOR)
    table = eqxs.sharding_table(mlp, name="model", rules=TENSOR)
    rows = {line.split()[0]: line.split()[-1] for line in table.splitlines()[2:-2]}
    assert rows == {
        "model.layers[0].weight": r"layers\[0\]\.weight$",
        "model.layers[0].bias": r"layers\[0\]\.bias$",
        "model.layers[1].weight": r"layers\[1\]\.weight$",
        "model.layers[1].bias": "default",
    }
    assert table.splitlines()[0].split() == [
        "path",
        "shape",
        "dtype",
        "sharding",
        "bytes/device",
        "rule",
    ]


def test_constructor_errors():
    with pytest.raises(ValueError, match="is not a regular expression"):
        eqxs.PathRules([("(", P())])
    with pytest.raises(TypeError, match="cannot hold another"):
        eqxs.PathRules([("a", eqxs.PathRules([]))])
    with pytest.raises(TypeError, match="rule 0"):
        eqxs.PathRules([("a", "model")])


def test_equal_rules_hash_equal():
    a = eqxs.PathRules([("w", P("x"))], default=None)
    b = eqxs.PathRules([("w", P("x"))], default=None)
    assert a == b and hash(a) == hash(b)
    assert a != eqxs.PathRules([("w", P("x"))])
    assert repr(a) == f"PathRules([('w', {P('x')!r})], default=None)"


def test_regex_flags_are_part_of_a_rule():
    insensitive = eqxs.PathRules([(re.compile("WEIGHT$", re.I), P("x"))], default=P())
    sensitive = eqxs.PathRules([("WEIGHT$", P("x"))], default=P())
    assert insensitive != sensitive
    assert insensitive.match("weight") == 0
    assert sensitive.match("weight") == 1  # the default


def test_a_pattern_that_is_not_a_string_is_refused(monkeypatch):
    # What a user without jaxtyping's checks sees (the suite's checks raise first).
    monkeypatch.setattr(jaxtyping.config, "jaxtyping_disable", True)
    with pytest.raises(TypeError) as info:
        eqxs.PathRules([("w", P()), (3, P("x"))])  # pyright: ignore[reportArgumentType]
    assert str(info.value).startswith(
        "PathRules: the pattern of rule 1 must be a string or a compiled regular "
        "expression; got "
    ), str(info.value)
