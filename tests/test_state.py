import equinox as eqx
import equinox_shard as eqxs
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from .helpers import assert_same_values


class _Model(eqx.Module):
    linear: eqx.nn.Linear
    bn: eqx.nn.BatchNorm

    def __init__(self, key):
        self.linear = eqx.nn.Linear(4, 8, key=key)
        self.bn = eqx.nn.BatchNorm(8, axis_name="batch", mode="ema")

    def __call__(self, x, state):
        return self.bn(self.linear(x), state)


def _mesh():
    return jax.make_mesh(
        (8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()
    )


# The running mean and variance, by where their `StateIndex` is in the model.
_RULES = eqxs.PathRules(
    [
        (r"^\.bn\.ema_state_index\[0\]$", P("x")),
        (r"^\.bn\.ema_state_index\[1\]$", P()),
    ],
    default=P(),
)


def test_state_entries_are_named_by_their_index_in_the_model(getkey):
    model, state = eqx.nn.make_with_state(_Model)(getkey())
    assert "flat index" in eqxs.sharding_table(state)  # Equinox's own key paths
    table = eqxs.sharding_table(state, model=model, name="state", rules=_RULES)
    rows = [line.split()[0] for line in table.splitlines()[2:-2]]
    assert rows == [
        "state.bn.ema_first_time_index",
        "state.bn.ema_state_index[0]",
        "state.bn.ema_state_index[1]",
    ], table
    assert "#0 " in table and "#1 " in table  # each placed by its rule
    with pytest.raises(ValueError, match="does not hold the `eqx.nn.StateIndex`"):
        eqxs.state_specs(model.linear, state, _RULES)


def test_path_rules_place_the_running_statistics(getkey):
    model, state = eqx.nn.make_with_state(_Model)(getkey())
    index = model.bn.ema_state_index
    assert index is not None  # `mode="ema"`
    mesh = _mesh()
    split, rep = NamedSharding(mesh, P("x")), NamedSharding(mesh, P())
    before = [np.array(x) for x in state.get(index)]
    with jax.set_mesh(mesh):
        specs = eqxs.state_specs(model, state, _RULES)
        placed = eqxs.filter_device_put(state, specs)
    mean, var = placed.get(index)
    assert mean.sharding == split and var.sharding == rep
    assert placed.get(model.bn.ema_first_time_index).sharding == rep
    assert_same_values(mean, before[0])
    assert_same_values(var, before[1])
    # The same specification in `filter_jit`: the step's state is placed and returned
    # there, whatever the input's placement.
    step = eqxs.filter_jit(
        lambda m, s, x: jax.vmap(
            m, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
        )(x, s),
        in_shardings=(rep, specs, rep),
        out_shardings=(rep, specs),
    )
    x = jnp.arange(16.0).reshape(4, 4)
    with jax.set_mesh(mesh):  # the rules give bare `PartitionSpec`s
        out, new_state = step(model, state, x)
    mean, var = new_state.get(index)
    assert mean.sharding == split and var.sharding == rep
    expected, expected_state = jax.vmap(
        model, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
    )(x, state)
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), atol=1e-4)
    want_mean, _ = expected_state.get(index)
    np.testing.assert_allclose(np.asarray(mean), np.asarray(want_mean), atol=1e-4)


class _Wide(eqx.Module):
    bn: eqx.nn.BatchNorm

    def __init__(self, width):
        self.bn = eqx.nn.BatchNorm(width, axis_name="batch", mode="ema")


def test_a_model_of_the_same_class_names_a_state_of_other_shapes():
    # The model only names the entries (`make_with_state` keys each by its class and
    # key path): a model of width 12 names the entries of a state of width 16, and the
    # specification fits the state's shapes (12 is not divisible by 8 devices, 16 is).
    model, _ = eqx.nn.make_with_state(_Wide)(12)
    other, state = eqx.nn.make_with_state(_Wide)(16)
    index = other.bn.ema_state_index
    assert index is not None
    before = [np.array(x) for x in state.get(index)]
    mesh = _mesh()
    with jax.set_mesh(mesh):
        specs = eqxs.state_specs(model, state, _RULES)
        placed = eqxs.filter_device_put(state, specs)
    mean, var = placed.get(index)
    assert mean.shape == (16,) and mean.sharding == NamedSharding(mesh, P("x"))
    assert var.sharding == NamedSharding(mesh, P())
    assert_same_values(mean, before[0])
    assert_same_values(var, before[1])
    # A model of another class holds other indices: refused, as before.
    with pytest.raises(ValueError, match="does not hold the `eqx.nn.StateIndex`"):
        eqxs.state_specs(_Model(jax.random.key(0)), state, _RULES)


@pytest.mark.parametrize(
    "where", ["filter_device_put", "filter_shard", "in_shardings", "out_shardings"]
)
def test_an_indivisible_state_entry_is_named_by_its_index(where):
    # Named as `state_specs` and `sharding_table(model=)` name it, where the error
    # said `x[<flat index 1>][0]` (Equinox flattens a `State` without keys).
    model, state = eqx.nn.make_with_state(_Wide)(12)  # 12: not divisible by 8
    before = [np.array(x) for x in jax.tree.leaves(state)]
    calls = {
        "filter_device_put": ("x", eqxs.filter_device_put),
        "filter_shard": ("x", eqxs.filter_shard),
        "in_shardings": (
            "s",
            lambda s, specs: eqxs.filter_jit(lambda s: s, in_shardings=(specs,))(s),
        ),
        "out_shardings": (
            "out",
            lambda s, specs: eqxs.filter_jit(lambda s: s, out_shardings=specs)(s),
        ),
    }
    name, call = calls[where]
    with jax.set_mesh(_mesh()):
        specs = eqxs.state_specs(model, state, _RULES)
        with pytest.raises(ValueError) as info:
            call(state, specs)
    assert str(info.value).startswith(
        f"{name}.bn.ema_state_index[0]: dimension 0 of shape (12,) has size 12, "
        "which is not divisible by the 8 devices"
    )
    for x, was in zip(jax.tree.leaves(state), before):
        assert_same_values(x, was)  # nothing deleted or changed
