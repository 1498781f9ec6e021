"""The same function, called again in another context: another mesh, an outer
transform after a concrete call, committed inputs, user PyTree classes, abstract
outputs, misspelt keys, and what placing promises about later donation (issue 22,
items 1 to 7; the crossed matrix is `test_context.py`)."""

import dataclasses

import equinox as eqx
import equinox_shard as eqxs
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from .helpers import assert_same_values, auto_mesh, explicit_mesh, snapshot


def _init(key):
    return {"weight": jax.random.normal(key, (8, 8)), "bias": jnp.zeros(8)}


_RULES = {
    "PathRules": eqxs.PathRules([(r"weight", P("data"))], default=P()),
    "callable": lambda x: P("data") if x.ndim == 2 else P(),
}


@pytest.mark.parametrize("kind", list(_RULES))
def test_rules_resolve_against_each_calls_mesh(kind):
    meshes = [
        auto_mesh((4, 2), ("data", "model")),
        auto_mesh((2, 4), ("data", "model")),
        auto_mesh(names=("data",)),
        explicit_mesh(names=("data",)),
        auto_mesh((4, 2), ("data", "model")),
    ]
    f = eqxs.filter_jit(_init, out_shardings=_RULES[kind])
    for mesh in meshes:
        # The same wrapper, and a new one of the same function (a shared cache).
        for g in (f, eqxs.filter_jit(_init, out_shardings=_RULES[kind])):
            with jax.set_mesh(mesh):
                out = g(jax.random.key(0))
            assert out["weight"].sharding == NamedSharding(mesh, P("data"))
            assert out["bias"].sharding == NamedSharding(mesh, P())


def test_bare_spec_in_shardings_follow_the_mesh():
    f = eqxs.filter_jit(lambda x: 2 * x, in_shardings=lambda x: P("data"))
    for shape in [(8,), (4, 2), (2, 4)]:
        mesh = auto_mesh(shape, ("data", "model")[: len(shape)])
        with jax.set_mesh(mesh):
            x = jax.device_put(jnp.arange(16.0), jax.devices()[0])
            out = f(x)
        assert out.sharding.is_equivalent_to(NamedSharding(mesh, P("data")), 1)
        assert np.array_equal(np.asarray(out), 2 * np.arange(16.0, dtype=np.float32))


def _mlp(key):
    return eqx.nn.MLP(16, 8, 32, 2, key=key)


# `jax.vmap` (the slowest to compile) is `slow`.
_OUTER = ["eval_shape", "filter_eval_shape", "jit"]
_VMAP = pytest.param("vmap", marks=pytest.mark.slow)


@pytest.mark.parametrize("outer", [*_OUTER, _VMAP])
def test_outer_transform_after_a_concrete_call(outer):
    f = eqxs.filter_jit(_mlp)
    key = jax.random.key(0)
    reference = f(key)
    weight = lambda k: f(k).layers[0].weight
    if outer == "eval_shape":
        out = jax.eval_shape(weight, key)
        assert (out.shape, out.dtype) == ((32, 16), jnp.float32)
    elif outer == "filter_eval_shape":
        out = eqx.filter_eval_shape(f, key)
        assert out.layers[0].weight.shape == (32, 16)
        assert out.activation is reference.activation
    elif outer == "jit":
        out = jax.jit(weight)(key)
        assert np.array_equal(np.asarray(out), np.asarray(reference.layers[0].weight))
    else:
        keys = jax.random.split(key, 4)
        out = jax.vmap(weight)(keys)
        assert out.shape == (4, 32, 16)
        assert np.array_equal(np.asarray(out[0]), np.asarray(weight(keys[0])))
    assert not key._base_array.is_deleted()  # pyright: ignore


def test_batch_made_under_set_mesh_is_moved():
    mesh = auto_mesh(names=("data",))
    f = eqxs.filter_jit(lambda x: x * 2, in_shardings=P("data"))
    with jax.set_mesh(mesh):
        batch = jnp.arange(32.0).reshape(8, 4) + 0  # committed, replicated
        assert batch.committed
        before = snapshot(batch)
        for _ in range(2):
            out = f(batch)
            assert out.sharding == NamedSharding(mesh, P("data"))
            assert_same_values(out, before * 2)
    assert batch.sharding.is_equivalent_to(NamedSharding(mesh, P()), 2)
    assert_same_values(batch, before)


@jtu.register_pytree_node_class
class _Named:
    """Validates its non-array child, as many user classes do."""

    def __init__(self, name, value):
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, got {name!r}")
        self.name = name
        self.value = value

    def tree_flatten(self):
        return (self.name, self.value), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)


@jtu.register_dataclass
@dataclasses.dataclass
class _Checked:
    value: jax.Array
    name: str = dataclasses.field(metadata=dict(static=False), default="w")

    def __post_init__(self):
        if not isinstance(self.name, str):
            raise TypeError(f"name must be a str, got {self.name!r}")


@pytest.mark.parametrize("make", [_Named, lambda n, v: _Checked(v, n)])
@pytest.mark.parametrize("shardings", ["none", "in", "out"])
def test_validating_pytrees(make, shardings):
    mesh = auto_mesh()
    s = NamedSharding(mesh, P("x"))
    kwargs = {"none": {}, "in": {"in_shardings": s}, "out": {"out_shardings": s}}
    tree = make("w", jnp.arange(8.0))
    f = eqxs.filter_jit(lambda t: (t, t.value + 1), **kwargs[shardings])
    # `eqx.filter_jit` takes such an argument (it cannot return one: it rebuilds its
    # output with `None` at non-array leaves); we take and return it.
    expected = eqx.filter_jit(lambda t: t.value + 1)(tree)
    for _ in range(2):
        out = f(tree)
        assert out[0].name == "w"
        assert_same_values(out[1], snapshot(expected))
        if shardings == "out":
            assert out[1].sharding == s
    compiled = f.lower(tree).compile()
    assert compiled.input_shardings[0][0].name == "w"  # non-arrays as themselves


def test_abstract_output_on_the_concrete_mesh():
    mesh = auto_mesh(names=("data",))
    f = eqxs.filter_jit(_init, out_shardings=_RULES["PathRules"])
    with jax.set_mesh(mesh):
        abstract = f.eval_shape(jax.random.key(0))
    assert abstract["weight"].sharding == NamedSharding(mesh, P("data"))
    assert abstract["bias"].sharding == NamedSharding(mesh, P())
    table = eqxs.sharding_table(abstract)
    assert "['weight']" in table and "data" in table


_MISSPELT = "at x\\['opt'\\] the value has this key but the specification does not; "
_MISSPELT += "the specification has 'optim', which the value does not"


def test_misspelt_key_names_both_sides():
    s = NamedSharding(auto_mesh(), P())
    value = {"params": jnp.ones(8), "opt": jnp.ones(8)}
    specs = {"params": s, "optim": s}
    for apply in (eqxs.filter_device_put, eqxs.filter_shard):
        with pytest.raises(ValueError, match=_MISSPELT):
            apply(value, specs)
    in_f = eqxs.filter_jit(lambda x: x, in_shardings=(specs,))
    with pytest.raises(ValueError, match=_MISSPELT):
        in_f(value)
    out_f = eqxs.filter_jit(lambda x: x, out_shardings=specs)
    with pytest.raises(ValueError, match=_MISSPELT.replace("at x", "at out")):
        out_f(value)


def test_shard_map_names_the_output():
    mesh = auto_mesh(names=("data",))

    def body(x):
        return {"total": x.sum(), "doubled": x * 2}

    mapped = eqxs.filter_shard_map(
        body, mesh=mesh, in_specs=P("data"), out_specs={"total": P(), "doubled": P()}
    )
    with pytest.raises(ValueError) as info:
        eqxs.filter_jit(mapped)(jnp.arange(16.0))
    message = str(info.value)
    assert "filter_shard_map(body)" in message
    assert "- out['total']:" in message and "- out['doubled']:" in message
    assert "out_specs[0]" not in message and "out_specs[1]" not in message


def test_placed_result_is_the_callers_array():
    # What README's "Nothing lost" says: an array already placed comes back as the
    # same object, so donating the result donates it; a moved array is a copy.
    s = NamedSharding(auto_mesh(), P("x"))
    placed = jax.device_put(jnp.arange(8.0), s)
    moved = jnp.arange(8.0)
    out = eqxs.filter_device_put({"placed": placed, "moved": moved}, s)
    assert out["placed"] is placed and out["moved"] is not moved
    copy = eqxs.filter_device_put(placed, s, may_alias=False)
    assert copy is not placed
    eqxs.filter_jit(lambda t: jtu.tree_map(lambda x: x + 1, t), donate="all")(
        (out, copy)
    )
    assert placed.is_deleted()  # donated through the result that is it
    assert not moved.is_deleted()
    assert np.array_equal(np.array(moved, copy=True), np.arange(8.0, dtype=np.float32))


def test_out_shardings_without_a_mesh_names_the_entry():
    f = eqxs.filter_jit(lambda a, b: (a, b), out_shardings=(P(), P("data")))
    with pytest.raises(ValueError, match=r"^out_shardings\[0\]: got the bare"):
        f(jnp.ones(2), jnp.ones(2))
