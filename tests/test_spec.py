"""The sharding-specification language shared by `filter_device_put`, `filter_shard`
(and `filter_jit`): spec-leaf kinds, prefix broadcasting, non-array leaves, errors."""

import contextlib
import functools as ft
import pathlib
import re
import threading

import equinox as eqx
import equinox_shard as eqxs
import equinox_shard._spec.kinds as kinds_module
import equinox_shard._spec.language as spec_module
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jax.sharding import make_single_device_sharding, NamedSharding, PartitionSpec as P

from .helpers import (
    assert_alive,
    assert_array_shardings,
    assert_same_values,
    assert_shardings,
    auto_mesh,
    explicit_mesh,
    grid_shape,
    make_module,
    mixed_mesh,
    nth_device,
    snapshot,
)


def _eager_device_put(x, spec):
    return eqxs.filter_device_put(x, spec)


def _eager_shard(x, spec):
    return eqxs.filter_shard(x, spec)


def _jit_shard(x, spec):
    return eqx.filter_jit(lambda y: eqxs.filter_shard(y, spec))(x)


def _jit_device_put(x, spec):
    return eqx.filter_jit(lambda y: eqxs.filter_device_put(y, spec))(x)


# Every way of calling the spec language on concrete arrays whose result is committed.
placers = pytest.mark.parametrize(
    "place", [_eager_device_put, _eager_shard, _jit_shard], ids=["put", "shard", "jit"]
)
# Also `filter_device_put` inside `jax.jit`, for errors (raised at trace time).
callers = pytest.mark.parametrize(
    "call",
    [_eager_device_put, _eager_shard, _jit_shard, _jit_device_put],
    ids=["put", "shard", "jit-shard", "jit-put"],
)


def _tree():
    return {
        "a": [jnp.arange(16.0), np.arange(32, dtype=np.int32).reshape(8, 4)],
        "b": (jnp.ones((8, 2)), 3, "hello"),
        "c": None,
    }


#
# Spec-leaf kinds.
#


@placers
@pytest.mark.parametrize("make_mesh", [auto_mesh, explicit_mesh])
def test_sharding_leaf(place, make_mesh):
    mesh = make_mesh(grid_shape(), ("data", "model"))
    x = _tree()
    expected = snapshot(x)
    sharding = NamedSharding(mesh, P("data"))
    with jax.set_mesh(mesh):  # Explicit meshes inside `jax.jit` need it.
        out = place(x, sharding)
    assert_shardings(out, sharding)
    assert_same_values(out, expected)


@pytest.mark.parametrize("place", [_eager_device_put, _eager_shard])
def test_device_leaf(place):
    device = nth_device(3)
    x = _tree()
    expected = snapshot(x)
    out = place(x, device)
    assert_shardings(out, make_single_device_sharding(device))
    for leaf in jax.tree.leaves(eqx.filter(out, eqx.is_array)):
        assert leaf.devices() == {device}
    assert_same_values(out, expected)


def test_device_leaf_per_subtree():
    one, five = nth_device(1), nth_device(5)
    x = _tree()
    expected = snapshot(x)
    out = eqxs.filter_device_put(x, {"a": one, "b": five, "c": None})
    assert out["a"][0].devices() == {one}
    assert out["a"][1].devices() == {one}
    assert out["b"][0].devices() == {five}
    assert_shardings(out["a"], make_single_device_sharding(one))
    assert_same_values(out, expected)


@placers
@pytest.mark.parametrize("make_mesh", [auto_mesh, explicit_mesh])
def test_bare_partition_spec_under_set_mesh(place, make_mesh):
    mesh = make_mesh(grid_shape(), ("data", "model"))
    x = _tree()
    expected = snapshot(x)
    with jax.set_mesh(mesh):
        out = place(x, {"a": [P("data"), P("data", "model")], "b": P(), "c": None})
    assert_array_shardings(
        out,
        [
            NamedSharding(mesh, P("data")),
            NamedSharding(mesh, P("data", "model")),
            NamedSharding(mesh, P()),
        ],
    )
    assert out["a"][0].sharding.mesh.axis_types == mesh.axis_types
    assert_same_values(out, expected)


def test_bare_partition_spec_as_global_set_mesh():
    mesh = auto_mesh()
    x = jnp.arange(16.0)
    jax.set_mesh(mesh)
    try:
        out = eqxs.filter_shard(x, P("x"))
    finally:
        jax.set_mesh(None)
    assert_shardings(out, NamedSharding(mesh, P("x")))
    assert_same_values(out, x)


@pytest.mark.parametrize("place", [_eager_device_put, _eager_shard])
def test_none_leaves_subtree_untouched(place):
    mesh = auto_mesh()
    sharding = NamedSharding(mesh, P("x"))
    numpy_leaf = np.arange(8.0)
    uncommitted = jnp.arange(8.0)
    committed = jax.device_put(jnp.arange(8.0), nth_device(2))
    x = {"keep": [numpy_leaf, uncommitted, committed, "s"], "move": jnp.arange(16.0)}
    expected = snapshot(x)
    out = place(x, {"keep": None, "move": sharding})
    # The very same objects: not even committed or converted to JAX arrays.
    for before, after in zip(x["keep"], out["keep"]):
        assert after is before
    assert not out["keep"][1].committed
    assert_shardings(out["move"], sharding)
    assert_same_values(out, expected)


@pytest.mark.parametrize("place", [_eager_device_put, _eager_shard])
def test_none_spec_returns_the_input(place):
    x = _tree()
    assert place(x, None) is x
    assert place(x, {"a": None, "b": None, "c": None}) is x


def test_none_is_not_constrained_inside_jit():
    mesh = auto_mesh()
    sharding = NamedSharding(mesh, P("x"))

    def f(x):
        return eqxs.filter_shard(x, {"keep": None, "move": sharding})

    x = {"keep": [jnp.arange(8.0), jnp.arange(16.0)], "move": jnp.arange(24.0)}
    jaxpr = jax.make_jaxpr(f)(x)
    constraints = [e for e in jaxpr.eqns if e.primitive.name == "sharding_constraint"]
    assert len(constraints) == 1
    # The two `keep` leaves are returned as the very inputs of the jaxpr.
    assert jaxpr.jaxpr.outvars[:2] == jaxpr.jaxpr.invars[:2]
    out = jax.jit(f)(x)
    assert_shardings(out["move"], sharding)
    assert_same_values(out, x)


def _shard_first_axis(leaf):
    """The rule from the docs: shard axis 0 over 'data' when divisible, else
    replicate."""
    if leaf.ndim > 0 and leaf.shape[0] % 4 == 0:
        return P("data")
    return P()


@placers
@pytest.mark.parametrize("make_mesh", [auto_mesh, explicit_mesh])
def test_callable_rule(place, make_mesh):
    mesh = make_mesh(grid_shape(), ("data", "model"))
    calls = []

    def rule(leaf):
        calls.append(leaf)
        return _shard_first_axis(leaf)

    x = {
        "a": jnp.ones((8, 3)),
        "b": np.ones(6, dtype=np.float32),
        "c": jnp.float32(2.0),
        "d": 5,
        "e": jnp.tanh,
    }
    expected = snapshot(x)
    with jax.set_mesh(mesh):
        out = place(x, rule)
    assert len(calls) == 3  # Only ever called on array leaves.
    assert_array_shardings(
        out,
        [
            NamedSharding(mesh, P("data")),
            NamedSharding(mesh, P()),
            NamedSharding(mesh, P()),
        ],
    )
    assert_same_values(out, expected)


@pytest.mark.parametrize("place", [_eager_device_put, _eager_shard])
def test_callable_rule_returning_each_spec_kind(place):
    mesh = auto_mesh()
    device = nth_device(6)
    sharding = NamedSharding(mesh, P("x"))
    untouched = jnp.arange(3.0)
    x = [jnp.arange(8.0), jnp.arange(16.0), jnp.arange(24.0), untouched]
    expected = snapshot(x)
    rules = [lambda _: sharding, lambda _: device, lambda _: P("x"), lambda _: None]
    with jax.set_mesh(mesh):
        out = place(x, rules)
    assert_array_shardings(
        out, [sharding, make_single_device_sharding(device), sharding, None]
    )
    assert out[3] is untouched
    assert_same_values(out, expected)


def test_callable_rule_inside_jit_sees_tracers():
    mesh = auto_mesh()
    seen = []

    def rule(leaf):
        seen.append(type(leaf))
        return NamedSharding(mesh, P("x")) if leaf.shape[0] == 8 else None

    @jax.jit
    def f(x):
        return eqxs.filter_shard(x, rule)

    x = (jnp.arange(8.0), jnp.arange(3.0))
    out = f(x)
    tracer = jax.core.Tracer  # pyright: ignore[reportAttributeAccessIssue]
    assert all(issubclass(t, tracer) for t in seen), seen
    assert len(seen) == 2
    assert_shardings(out[0], NamedSharding(mesh, P("x")))
    assert_same_values(out, x)


def test_callable_module_is_a_tree_not_a_rule():
    # A callable that is also a PyTree node (an `eqx.Module` with `__call__`) is a
    # specification tree, not a rule.
    mesh = auto_mesh()
    sharding = NamedSharding(mesh, P())
    linear = make_module(eqx.nn.Linear, 16, 16)
    spec = jax.tree.map(lambda _: sharding, linear)
    out = eqxs.filter_device_put(linear, spec)
    assert_shardings(out, sharding)
    assert_same_values(out, linear)


#
# Prefix broadcasting.
#


def _deep_tree():
    return {
        "a": [jnp.arange(8.0), {"c": jnp.arange(16.0), "d": (jnp.arange(24.0), 1.5)}],
        "b": jnp.arange(32.0),
    }


@pytest.mark.parametrize("depth", [0, 1, 2, 3])
@pytest.mark.parametrize("place", [_eager_device_put, _eager_shard, _jit_shard])
def test_prefix_broadcasting(depth, place):
    mesh = auto_mesh(grid_shape(), ("data", "model"))
    r = NamedSharding(mesh, P())
    d = NamedSharding(mesh, P("data"))
    m = NamedSharding(mesh, P("model"))
    dm = NamedSharding(mesh, P(("data", "model")))
    # Expected sharding of the leaves a[0], a[1]['c'], a[1]['d'][0], b.
    spec, expected_shardings = {
        0: (d, [d, d, d, d]),
        1: ({"a": m, "b": dm}, [m, m, m, dm]),
        2: ({"a": [r, d], "b": None}, [r, d, d, None]),
        3: ({"a": [m, {"c": dm, "d": (r, None)}], "b": d}, [m, dm, r, d]),
    }[depth]
    x = _deep_tree()
    expected = snapshot(x)
    out = place(x, spec)
    leaves = jax.tree.leaves(eqx.filter(out, eqx.is_array))
    assert len(leaves) == 4
    for leaf, sharding in zip(leaves, expected_shardings):
        if sharding is None:
            if place is not _jit_shard:
                assert leaf is x["b"]
        else:
            assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim), (
                leaf.sharding,
                sharding,
            )
    assert_same_values(out, expected)


def test_module_shaped_spec():
    # The usual way to build a per-parameter specification: map over the model.
    mesh = auto_mesh(grid_shape(), ("data", "model"))
    model = make_module(eqx.nn.MLP, 8, 4, 16, 2)
    expected = snapshot(model)
    spec = jax.tree.map(
        lambda x: NamedSharding(mesh, P("model") if x.ndim == 1 else P("data", None)),
        eqx.filter(model, eqx.is_array),
    )
    out = eqxs.filter_device_put(model, spec)
    for leaf, s in zip(
        jax.tree.leaves(eqx.filter(out, eqx.is_array)), jax.tree.leaves(spec)
    ):
        assert leaf.sharding.is_equivalent_to(s, leaf.ndim)
    assert out.activation is model.activation
    assert out.final_activation is model.final_activation
    assert_same_values(out, expected)


#
# Non-array leaves are returned as the very same object.
#


def _non_arrays():
    def function(y):
        return y

    return [
        1,
        2.5,
        True,
        1 + 2j,
        "string",
        function,
        jnp.tanh,
        None,
        jax.ShapeDtypeStruct((8,), jnp.float32),
        object(),
        eqx.nn.MLP,
    ]


def _rule(leaf):
    assert eqx.is_array(leaf), leaf
    return P("x")


@pytest.mark.parametrize(
    "make_spec",
    [
        lambda mesh: NamedSharding(mesh, P("x")),
        lambda mesh: nth_device(1),
        lambda mesh: P("x"),
        lambda mesh: None,
        lambda mesh: _rule,
    ],
    ids=["sharding", "device", "bare-P", "None", "rule"],
)
@pytest.mark.parametrize("function", [eqxs.filter_device_put, eqxs.filter_shard])
@pytest.mark.parametrize("jit", [False, True])
def test_non_array_leaves_are_the_same_object(make_spec, function, jit):
    mesh = auto_mesh()
    spec = make_spec(mesh)
    x = [jnp.arange(8.0), *_non_arrays()]
    expected = snapshot(x)
    place = ft.partial(function, device_or_shardings=spec)
    if jit:
        place = eqx.filter_jit(place)
    # (A `jax.Device` target inside `jax.jit` must not meet an 8-device context mesh.)
    context = (
        jax.set_mesh(mesh) if spec in (P("x"), _rule) else contextlib.nullcontext()
    )
    with context:
        out = place(x)
    assert len(out) == len(x)
    for a, b in zip(out[1:], x[1:]):
        assert a is b
    assert_same_values(out, expected)


@pytest.mark.parametrize("place", [_eager_device_put, _eager_shard])
def test_mlp_activations_are_the_same_object(place):
    mesh = auto_mesh(grid_shape(), ("data", "model"))
    model = make_module(
        eqx.nn.MLP, 8, 4, 16, 2, activation=jax.nn.gelu, final_activation=jnp.tanh
    )
    expected = snapshot(model)
    with jax.set_mesh(mesh):
        out = place(model, lambda x: P("data", "model") if x.ndim == 2 else P())
    assert out.activation is jax.nn.gelu
    assert out.final_activation is jnp.tanh
    weight = NamedSharding(mesh, P("data", "model"))
    bias = NamedSharding(mesh, P())
    assert_array_shardings(out, [weight, bias] * 3)
    assert_same_values(out, expected)


#
# Errors: raised before anything is transferred or traced, naming the leaf by its key
# path, saying what was expected and what was found; every input left as it was.
#


@pytest.fixture
def placements(monkeypatch):
    """Counts the calls to every JAX function that places or constrains an array."""
    calls = []
    for module, name in [
        (jax, "device_put"),
        (jax.lax, "with_sharding_constraint"),
        (jax.sharding, "reshard"),
    ]:
        original = getattr(module, name)

        def wrapper(*args, __original=original, __name=name, **kwargs):
            calls.append(__name)
            return __original(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)
    return calls


def _error_tree():
    return {
        "a": [jnp.arange(16.0), np.arange(8.0, dtype=np.float32)],
        "b": (jnp.ones((8, 2)), "s"),
        "c": jnp.float32(3.0),
    }


def _spec(mesh, **overrides):
    r = NamedSharding(mesh, P())
    spec = {"a": [r, r], "b": [r, None], "c": r}
    for path, value in overrides.items():
        key, *index = path
        if index:
            spec[key][int(index[0])] = value
        else:
            spec[key] = value
    if isinstance(spec["b"], list):
        spec["b"] = tuple(spec["b"])
    return spec


def _s(mesh, *spec):
    return NamedSharding(mesh, P(*spec))


# (spec(mesh), exception, pieces of the message, whether `jax.set_mesh` is used)
_errors = {
    "missing-key": (
        lambda m: {"a": _s(m), "b": _s(m)},
        ValueError,
        ["x['c']", "the value has this key but the specification does not"],
    ),
    "extra-key": (
        lambda m: {"a": _s(m), "b": _s(m), "c": _s(m), "d": _s(m)},
        ValueError,
        ["x['d']", "the specification has this key but the value does not"],
    ),
    "list-vs-tuple": (
        lambda m: {"a": _s(m), "b": [_s(m), None], "c": _s(m)},
        ValueError,
        ["x['b']", "a list of length 2", "a tuple of length 2"],
    ),
    "wrong-length": (
        lambda m: {"a": [_s(m)], "b": _s(m), "c": _s(m)},
        ValueError,
        ["x['a']", "a list of length 1", "a list of length 2"],
    ),
    "spec-deeper-than-value": (
        lambda m: {"a": _s(m), "b": _s(m), "c": {"d": _s(m)}},
        ValueError,
        ["x['c']", "a dict with keys", "an array leaf of shape () and dtype float32"],
    ),
    "rank": (
        lambda m: _spec(m, a0=_s(m, "x", None)),
        ValueError,
        ["x['a'][0]", "P('x', None)", "2 entries", "shape (16,)", "rank 1"],
    ),
    "scalar": (
        lambda m: _spec(m, c=_s(m, "x")),
        ValueError,
        ["x['c']", "P('x',)", "shape ()", "rank 0", "should be P()"],
    ),
    "indivisible": (
        lambda m: _spec(m, b0=_s(m, None, "x")),
        ValueError,
        ["x['b'][0]", "dimension 1", "(8, 2)", "size 2", "not divisible", "8 devices"],
    ),
    "unknown-axis": (
        lambda m: _spec(m, a1=P("y")),
        ValueError,
        ["x['a'][1]", "y", "not found in mesh"],
        True,
    ),
    "duplicate-axis": (
        lambda m: _spec(m, b0=P("x", "x")),
        ValueError,
        ["x['b'][0]", "P('x', 'x')", "duplicate"],
        True,
    ),
    "bare-P-no-mesh": (
        lambda m: _spec(m, a1=P("x")),
        ValueError,
        ["x['a'][1]", "P('x',)", "no mesh is set", "jax.set_mesh"],
    ),
    "string-leaf": (
        lambda m: _spec(m, a1="x"),
        TypeError,
        ["device_or_shardings['a'][1]", "got str 'x'", "jax.sharding.Sharding"],
    ),
    "int-leaf": (
        lambda m: _spec(m, c=3),
        TypeError,
        ["device_or_shardings['c']", "got int 3"],
    ),
    "mesh-leaf": (
        lambda m: _spec(m, b=m),
        TypeError,
        [
            "device_or_shardings['b']",
            "got Mesh",
            " A mesh is not a sharding: pass `jax.sharding.NamedSharding(mesh, spec)`,"
            " or set the mesh with `jax.set_mesh(mesh)` and pass a bare "
            "`PartitionSpec`.",
        ],
    ),
    "rule-returns-non-spec": (
        lambda m: _spec(m, b0=lambda leaf: "x"),
        TypeError,
        ["x['b'][0]", "must return", "got str 'x'"],
    ),
}


@callers
@pytest.mark.parametrize("case", list(_errors))
def test_errors(case, call, placements):
    mesh = auto_mesh()
    if case == "indivisible" and mesh.size < 8:
        n, backend = jax.device_count(), jax.default_backend()
        why = "a dimension size that 8 devices do not divide"
        pytest.skip(f"needs 8 devices: {why}; {n} {backend} device(s) present")
    make_spec, error, pieces, *use_mesh = _errors[case]
    x = _error_tree()
    expected = snapshot(x)
    context = jax.set_mesh(mesh) if use_mesh else contextlib.nullcontext()
    with context, pytest.raises(error) as info:
        call(x, make_spec(mesh))
    message = str(info.value)
    for piece in pieces:
        assert piece in message, (piece, message)
    assert placements == []  # Raised before anything was placed or constrained.
    assert_alive(x)
    assert_same_values(x, expected)
    assert not x["a"][0].committed


def test_error_rule_that_raises(placements):
    class Oops(Exception):
        pass

    def rule(leaf):
        if leaf.ndim == 2:
            raise Oops("no rule for matrices")
        return None

    x = _error_tree()
    expected = snapshot(x)
    with pytest.raises(ValueError, match="no rule for matrices") as info:
        eqxs.filter_device_put(x, rule, donate=True)
    assert "x['b'][0]" in str(info.value)
    assert "raised Oops" in str(info.value)
    assert isinstance(info.value.__cause__, Oops)
    assert placements == []
    assert_alive(x)
    assert_same_values(x, expected)


def test_error_module_of_another_type():
    mesh = auto_mesh()
    model = {"m": make_module(eqx.nn.MLP, 8, 4, 16, 2)}
    expected = snapshot(model)
    linear = eqx.filter_eval_shape(eqx.nn.Linear, 16, 16, key=jr.key(0))
    spec = {"m": jax.tree.map(lambda _: _s(mesh), linear)}
    with pytest.raises(ValueError) as info:
        eqxs.filter_device_put(model, spec)
    message = str(info.value)
    assert "x['m']" in message
    assert "equinox.nn._linear.Linear" in message
    assert "equinox.nn._mlp.MLP" in message
    assert_alive(model)
    assert_same_values(model, expected)


def test_error_module_with_other_static_fields():
    mesh = auto_mesh()
    model = [make_module(eqx.nn.MLP, 8, 4, 16, 2)]
    wider = eqx.filter_eval_shape(eqx.nn.MLP, 8, 4, 32, 2, key=jr.key(0))
    spec = [jax.tree.map(lambda _: _s(mesh), eqx.filter(wider, eqx.is_array))]
    with pytest.raises(ValueError) as info:
        eqxs.filter_shard(model, spec)
    message = str(info.value)
    assert "x[0]" in message
    assert "static" in message
    assert "32" in message and "16" in message
    assert_alive(model)


@pytest.mark.parametrize("function", [eqxs.filter_device_put, eqxs.filter_shard])
def test_error_deleted_input(function, placements):
    mesh = auto_mesh()
    deleted = jax.device_put(jnp.arange(8.0), nth_device(1))
    deleted.delete()
    alive = jnp.arange(16.0)
    x = {"first": alive, "second": [deleted]}
    placements.clear()
    with pytest.raises(RuntimeError) as info:
        function(x, _s(mesh, "x"))
    message = str(info.value)
    assert "x['second'][0]" in message
    assert "deleted" in message
    assert placements == []
    assert not alive.is_deleted()
    assert not alive.committed


@pytest.mark.parametrize("function", [eqxs.filter_device_put, eqxs.filter_shard])
def test_error_mixed_auto_explicit_inside_trace(function):
    mesh = mixed_mesh()
    sharding = _s(mesh, "data", "model")
    x = {"w": jnp.ones((8, 4)), "n": 1}
    expected = snapshot(x)

    @eqx.filter_jit
    def f(y):
        return eqxs.filter_shard(y, sharding)

    with jax.set_mesh(mesh):
        with pytest.raises(ValueError) as info:
            f(x)
        message = str(info.value)
        assert "x['w']" in message
        assert "P('data', 'model')" in message
        assert "Explicit mesh axes ['data']" in message
        assert "Auto mesh axes ['model']" in message
        # Eagerly it is a plain transfer, which is fine.
        out = function(x, sharding)
    assert_shardings(out, sharding)
    assert_same_values(out, expected)
    assert_alive(x)


def test_every_kind_is_named_where_the_kinds_are_listed():
    # Each kind by its full name, as `_spec.kinds` names it in messages.
    kinds = [re.match(r"`([^`]+)`", k.name).group(1) for k in kinds_module.KINDS]  # pyright: ignore[reportOptionalMemberAccess]
    docs = {
        "the language (_spec.language)": spec_module.__doc__,
        "filter_device_put": eqxs.filter_device_put.__doc__,
        "filter_shard": eqxs.filter_shard.__doc__,
        "filter_jit": eqxs.filter_jit.__doc__,
        "PathRules": eqxs.PathRules.__doc__,
        "docs/semantics.md": (
            pathlib.Path(__file__).parents[1] / "docs" / "semantics.md"
        ).read_text(),
    }
    missing = {
        name: [k for k in kinds if k not in str(doc)] for name, doc in docs.items()
    }
    assert missing == dict.fromkeys(docs, [])
    assert "jax.memory.Space" in kinds  # the newest kind, read from the table


def test_every_refusal_in_the_kinds_table_has_its_hint():
    # A flag without its message would raise an error that explains nothing; a
    # message without its flag would never be shown.
    refusals = {
        kind.name: (
            (kind.placement_only, bool(kind.placement_hint)),
            (kind.in_trace is kinds_module.InTrace.REFUSED, bool(kind.in_trace_hint)),
            (kind.jit_in_refused, bool(kind.jit_in_hint)),
        )
        for kind in kinds_module.KINDS
    }
    mismatched = {
        name: pairs for name, pairs in refusals.items() if any(a != b for a, b in pairs)
    }
    assert mismatched == {}
    # The table does refuse: `Format` in a trace, `Space` in `in_shardings`.
    assert any(flags[1][0] for flags in refusals.values())
    assert any(flags[2][0] for flags in refusals.values())


class _WithStatic(eqx.Module):
    weight: jax.Array
    t1: float


def _placing_function(function: str, spec):
    """`function` given `spec`, called as `call(value)`."""
    scaled = lambda m: m.weight * m.t1
    if function == "filter_jit":
        return eqxs.filter_jit(scaled, in_shardings=(spec,))
    if function == "filter_shard_map":
        return eqxs.filter_shard_map(scaled, in_specs=(spec,), out_specs=P())
    return lambda m: getattr(eqxs, function)(m, spec).weight


@pytest.mark.parametrize(
    "function", ["filter_device_put", "filter_shard", "filter_jit", "filter_shard_map"]
)
def test_a_spec_tree_keeping_non_array_leaves_is_one_rule(function):
    # A spec tree made by `jax.tree.map` over a Module keeps its non-array leaves
    # (`t1=10.0`): every function takes it, also for a Module whose `t1` has changed
    # since (`filter_jit` and `filter_shard_map` refused it before, when decorating).
    mesh = jax.make_mesh(
        (jax.device_count(),), ("x",), axis_types=(jax.sharding.AxisType.Explicit,)
    )
    model = _WithStatic(jnp.arange(8.0), 10.0)
    spec = jax.tree.map(lambda x: P() if eqx.is_array(x) else x, model)
    assert spec.t1 == 10.0
    with jax.set_mesh(mesh):
        call = _placing_function(function, spec)
        for t1 in (10.0, 2.0):
            out = call(_WithStatic(jnp.arange(8.0), t1))
            # The two placing functions return the weight, the others `weight * t1`.
            scale = t1 if function in ("filter_jit", "filter_shard_map") else 1.0
            expected = np.arange(8.0, dtype=np.float32) * scale
            np.testing.assert_array_equal(np.asarray(out), expected)
            assert out.sharding.is_equivalent_to(NamedSharding(mesh, P()), 1)


@pytest.mark.parametrize(
    "function", ["filter_device_put", "filter_shard", "filter_jit", "filter_shard_map"]
)
def test_a_non_spec_leaf_at_an_array_is_named(function):
    mesh = jax.make_mesh(
        (jax.device_count(),), ("x",), axis_types=(jax.sharding.AxisType.Explicit,)
    )
    spec = _WithStatic(10.0, 10.0)  # pyright: ignore[reportArgumentType]
    # Named in the argument's names, then the specification's.
    named = {
        "filter_device_put": "x.weight (`device_or_shardings.weight`)",
        "filter_shard": "x.weight (`device_or_shardings.weight`)",
        "filter_jit": "m.weight (`in_shardings[0].weight`)",
        "filter_shard_map": "args[0].weight (`in_specs[0].weight`)",
    }[function]
    with jax.set_mesh(mesh):
        message = ": a sharding specification leaf must be .*; got float 10\\.0"
        with pytest.raises(TypeError, match="^" + re.escape(named) + message):
            _placing_function(function, spec)(_WithStatic(jnp.arange(8.0), 10.0))


def _over_container(where: str, tmp_path: pathlib.Path):
    """`(call, traced)`: `call()` gives `where` the spec `{"a": 3}` (a number over the
    list of arrays `[x]`); `traced` lists what the function traced."""
    value, spec, traced = {"a": [jnp.arange(8.0)]}, {"a": 3}, []

    def body(v):
        traced.append(v)
        return v

    calls = {
        "filter_device_put": lambda: eqxs.filter_device_put(value, spec),
        "filter_shard": lambda: eqxs.filter_shard(value, spec),
        "filter_jit in_shardings": lambda: eqxs.filter_jit(body, in_shardings=(spec,))(
            value
        ),
        "filter_jit in_shardings dict": lambda: eqxs.filter_jit(
            body, in_shardings={"v": spec}
        )(value),
        "filter_jit out_shardings": lambda: eqxs.filter_jit(body, out_shardings=spec)(
            value
        ),
        "filter_shard_map in_specs": lambda: eqxs.filter_shard_map(
            body, in_specs=(spec,), out_specs=P()
        )(value),
        "filter_shard_map out_specs": lambda: eqxs.filter_shard_map(
            body, in_specs=P(), out_specs=spec
        )(value),
    }
    if where == "restore":
        eqxs.save(tmp_path / "ckpt", value)
        return lambda: eqxs.restore(tmp_path / "ckpt", value, spec), traced
    if where == "state_specs":
        model, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(8, "batch", mode="ema")
        return lambda: eqxs.state_specs(model, state, 3), traced
    return calls[where], traced


@pytest.mark.parametrize(
    "where, named",
    [
        ("filter_device_put", "x['a'] (`device_or_shardings['a']`)"),
        ("filter_shard", "x['a'] (`device_or_shardings['a']`)"),
        ("filter_jit in_shardings", "v['a'] (`in_shardings[0]['a']`)"),
        ("filter_jit in_shardings dict", "v['a'] (`in_shardings['v']['a']`)"),
        ("filter_jit out_shardings", "out['a'] (`out_shardings['a']`)"),
        ("filter_shard_map in_specs", "args[0]['a'] (`in_specs[0]['a']`)"),
        ("filter_shard_map out_specs", "out['a'] (`out_specs['a']`)"),
        ("restore", "like['a'] (`shardings['a']`)"),
        ("state_specs", "state (`specs`)"),
    ],
)
def test_a_number_over_a_container_of_arrays_is_named(where, named, tmp_path):
    # A spec leaf that is no spec over arrays is an error naming it, also over a
    # container of them: `3` over `[x]` was taken as `None` (as it is over `t1=10.0`),
    # and the arrays were left as they were.
    mesh = jax.make_mesh(
        (jax.device_count(),), ("x",), axis_types=(jax.sharding.AxisType.Explicit,)
    )
    with jax.set_mesh(mesh):
        call, traced = _over_container(where, tmp_path)
        message = ": a sharding specification leaf must be .*; got int 3\\."
        with pytest.raises(TypeError, match="^" + re.escape(named) + message):
            call()
    # Refused before anything is traced, but for the output's own specification.
    assert len(traced) == (1 if "out_" in where else 0)


def test_no_mesh_in_a_worker_thread_says_set_mesh_is_per_thread():
    # `jax.set_mesh` in the main thread does not reach a worker thread: the message
    # says so, where it said only "no mesh is set".
    errors = []

    def worker():
        try:
            eqxs.filter_device_put(jnp.ones(8), P())
        except ValueError as e:
            errors.append(str(e))

    with jax.set_mesh(jax.make_mesh((jax.device_count(),), ("x",))):
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
    assert len(errors) == 1
    assert errors[0].startswith("x: got the bare PartitionSpec P(), but no mesh is set")
    assert "`jax.set_mesh(mesh)` (per thread" in errors[0]


def test_a_module_spec_of_another_shape_names_its_static_fields():
    # A spec made for an MLP of another depth: the message names the static field
    # that differs, where it printed the Module's static data unlabelled.
    shallow = eqx.nn.MLP(2, 2, 4, 2, key=jr.key(0))
    deep = eqx.nn.MLP(2, 2, 4, 3, key=jr.key(0))
    spec = jax.tree.map(lambda x: P() if eqx.is_array(x) else x, shallow)
    with jax.set_mesh(jax.make_mesh((jax.device_count(),), ("x",))):
        with pytest.raises(
            ValueError,
            match=r"static fields differ from the value's: "
            r"depth=2 \(the value's: 3\)\.$",
        ):
            eqxs.filter_device_put(deep, spec)


def test_variadic_in_shardings_of_another_length_hints_the_single_form():
    f = eqxs.filter_jit(lambda *args: args, in_shardings=(P(),))
    with jax.set_mesh(jax.make_mesh((jax.device_count(),), ("x",))):
        with pytest.raises(ValueError, match=r"pass it alone: `in_shardings=spec`"):
            f(jnp.ones(8), jnp.ones(8))


def test_path_rules_take_a_dict_in_its_order():
    # `PathRules({pattern: spec})` said "rule 0 must be a pair; got str".
    rules = eqxs.PathRules({"weight": P("x"), "w": P()}, default=None)
    assert rules == eqxs.PathRules([("weight", P("x")), ("w", P())], default=None)
