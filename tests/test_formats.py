"""Layouts (RFC §4): `jax.experimental.layout.Format` as a spec leaf, and the
ahead-of-time flow `filter_jit(in_shardings=Format(Layout.AUTO, s)).lower(...)`
`.compile()`, `filter_device_put(tree, compiled.input_formats)`, then the call.

On CPU the compiler chooses the default layout for every input, so the flow cannot
show a relayout avoided there; what these tests check is that the formats come back in
the user's structure, that placing with them gives each array exactly that format, that
neither the compiled step nor the `filter_jit` call compiles again, and that an array
in another layout (which CPU can hold: `Layout((1, 0))`) is refused by the compiled step
and put right by `filter_device_put`. Outputs do differ on CPU: a transpose under
`out_shardings=Format(Layout.AUTO, s)` comes back in layout `(1, 0)`.
"""

import equinox as eqx
import equinox_shard as eqxs
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from jax.experimental.layout import Format, Layout
from jax.sharding import NamedSharding, PartitionSpec as P

from .helpers import assert_alive, auto_mesh, chip_mesh, count_compiles, make_module


def _step(model, key, x, label):
    noise = jax.random.normal(key, x.shape)
    y = jax.vmap(model)(x + noise)
    return model, jax.random.split(key)[0], y, label


def _struct(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype) if eqx.is_array(x) else x


def _flow():
    mesh = auto_mesh()
    r, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("x"))
    auto_r, auto_batch = Format(Layout.AUTO, r), Format(Layout.AUTO, batch)

    def step(model, key, x, label):  # a fresh function: a cache of its own
        return _step(model, key, x, label)

    step = eqxs.filter_jit(
        step,
        in_shardings=(auto_r, auto_r, auto_batch, None),
        out_shardings=(r, r, batch, None),
    )
    model = make_module(eqx.nn.MLP, 4, 4, 8, 1)
    key = jax.random.key(0)
    x = jnp.ones((16, 4))
    return step, (model, key, x, "label"), (r, batch)


def test_lower_compile_place_call_compiles_once():
    step, (model, key, x, label), (r, batch) = _flow()
    with count_compiles() as lowering:
        compiled = step.lower(*jtu.tree_map(_struct, (model, key, x)), label).compile()
    assert len(lowering) == 1
    args, kwargs = compiled.input_formats
    assert kwargs == {}
    f_model, f_key, f_x, f_label = args
    # The user's structure; non-array leaves as themselves.
    assert jtu.tree_structure(f_model, is_leaf=lambda a: isinstance(a, Format)) == (
        jtu.tree_structure(model)
    )
    assert f_model.activation is model.activation
    assert f_label == "label"
    for fmt in jtu.tree_leaves(f_model) + [f_key, f_x]:
        if isinstance(fmt, Format):
            assert isinstance(fmt.layout, Layout)  # chosen: concrete
    assert f_x.sharding == batch and f_model.layers[0].weight.sharding == r
    formats, _ = compiled.input_formats
    placed = eqxs.filter_device_put((model, key, x, label), formats)
    p_model, p_key, p_x, p_label = placed
    assert p_label == "label" and p_model.activation is model.activation
    assert p_x.format == f_x
    assert p_model.layers[0].weight.format == f_model.layers[0].weight
    assert jnp.issubdtype(p_key.dtype, jax.dtypes.prng_key)
    assert p_key.sharding == r
    with count_compiles() as calls:
        out = compiled(*placed)
        out = compiled(*placed)
        out = step(*placed)  # the `filter_jit` call: the compiled executable
        out = step(*placed)
    assert len(calls) == 0
    assert out[3] == "label" and out[0].activation is model.activation
    assert out[2].shape == (16, 4) and out[2].sharding.is_equivalent_to(batch, 2)


def test_output_formats_in_the_users_structure():
    step, (model, key, x, label), (r, batch) = _flow()
    compiled = step.lower(*jtu.tree_map(_struct, (model, key, x)), label).compile()
    f_model, f_key, f_y, f_label = compiled.output_formats
    assert f_label == "label" and f_model.activation is model.activation
    assert isinstance(f_y, Format) and f_y.sharding == batch
    formats, _ = compiled.input_formats
    placed = eqxs.filter_device_put((model, key, x, label), formats)
    out = compiled(*placed)
    assert out[2].format.layout == f_y.layout


def test_auto_output_layout_differs_on_cpu():
    """The compiler chooses a non-default layout for an output that is a transpose."""
    s = NamedSharding(auto_mesh(), P("x"))
    f = eqxs.filter_jit(
        lambda a, n: (a.T, n), out_shardings=(Format(Layout.AUTO, s), None)
    )
    a = eqxs.filter_device_put(jnp.ones((8, 16)), s)
    compiled = f.lower(a, 3).compile()
    fmt, n = compiled.output_formats
    assert n == 3
    assert fmt.layout.major_to_minor == (1, 0)
    out, n = compiled(a, 3)
    assert out.format == fmt


def test_another_layout_is_refused_then_put_right():
    """CPU can hold an array in layout `(1, 0)`: the compiled step refuses it (JAX never
    relayouts a compiled step's argument silently) and `filter_device_put` with the
    compiled formats puts it right."""
    s = NamedSharding(auto_mesh(), P("x"))
    f = eqxs.filter_jit(lambda a: a * 2, in_shardings=Format(Layout.AUTO, s))
    compiled = f.lower(jax.ShapeDtypeStruct((8, 8), jnp.float32)).compile()
    (fmt,), _ = compiled.input_formats
    other = eqxs.filter_device_put(jnp.ones((8, 8)), Format(Layout((1, 0)), s))
    assert other.format.layout.major_to_minor == (1, 0)
    with pytest.raises(ValueError, match="layout"):
        compiled(other)
    placed = eqxs.filter_device_put(other, fmt)
    assert placed.format == fmt and placed is not other
    assert eqxs.filter_device_put(placed, fmt) is placed  # already there
    with count_compiles() as calls:
        compiled(placed)
        f(placed)
    assert len(calls) == 0


@pytest.mark.devices(2, reason="one device divides every dimension size")
def test_device_put_with_a_format():
    s = NamedSharding(auto_mesh(), P("x"))
    fmt = Format(Layout((1, 0)), s)
    tree = {"w": jnp.ones((8, 8)), "n": 3, "f": jnp.sin}
    out = eqxs.filter_device_put(tree, {"w": fmt, "n": None, "f": None})
    assert out["w"].format.layout.major_to_minor == (1, 0)
    assert out["w"].sharding == s and out["n"] == 3 and out["f"] is jnp.sin
    # Its sharding is checked as any sharding.
    with pytest.raises(ValueError, match=r"x\['w'\].*not divisible"):
        eqxs.filter_device_put({"w": jnp.ones((3, 8))}, fmt)
    with pytest.raises(ValueError, match=r"x\['w'\].*rank"):
        eqxs.filter_device_put({"w": jnp.ones(8)}, Format(Layout((1, 0)), s))


def test_device_put_with_auto_names_the_leaf():
    s = NamedSharding(auto_mesh(), P("x"))
    with pytest.raises(
        ValueError, match=r"x\['w'\].*Layout.AUTO.*compiled.input_formats"
    ):
        eqxs.filter_device_put({"w": jnp.ones((8, 8))}, Format(Layout.AUTO, s))


def test_format_without_sharding_is_a_type_error():
    with pytest.raises(TypeError, match=r"device_or_shardings\['w'\].*Format"):
        eqxs.filter_device_put({"w": jnp.ones(8)}, {"w": Format(Layout.AUTO)})


def test_auto_at_call_time_names_the_key_path():
    step, (model, key, x, label), _ = _flow()
    with count_compiles() as compiles:
        with pytest.raises(ValueError, match=r"model\.layers\[0\]\.weight.*lower"):
            step(model, key, x, label)
    assert len(compiles) == 0
    # Lowered but not compiled: still refused, naming the leaf.
    step.lower(*jtu.tree_map(_struct, (model, key, x)), label)
    with pytest.raises(ValueError, match=r"model\.layers\[0\]\.weight.*compile"):
        step(model, key, x, label)


def test_filter_shard_in_a_trace_refuses_a_format():
    s = NamedSharding(auto_mesh(), P("x"))

    @jax.jit
    def f(a):
        return eqxs.filter_shard({"a": a}, Format(Layout((0,)), s))

    with pytest.raises(TypeError, match=r"x\['a'\].*Format.*with_layout_constraint"):
        f(jnp.ones(8))
    # Outside a trace it is `filter_device_put`.
    out = eqxs.filter_shard(jnp.ones(8), Format(Layout((0,)), s))
    assert out.format.layout.major_to_minor == (0,) and out.sharding == s


def test_filter_shard_map_refuses_a_format():
    mesh = auto_mesh()
    s = NamedSharding(mesh, P("x"))
    with pytest.raises(TypeError, match=r"in_specs.*Format"):
        eqxs.filter_shard_map(
            lambda a: a, mesh=mesh, in_specs=Format(Layout.AUTO, s), out_specs=P("x")
        )(jnp.ones(8))


def test_auto_flow_with_an_input_the_function_does_not_use():
    # XLA prunes the bias: `compiled.input_formats` holds `Format(None, None)` for it,
    # which `jax.device_put` takes as "leave it as it is".
    s = NamedSharding(auto_mesh(), P())
    f = lambda m, x: m.weight @ x
    g = eqxs.filter_jit(f, in_shardings=(Format(Layout.AUTO, s), None))
    model = make_module(eqx.nn.Linear, 4, 3)
    x = jnp.arange(4.0)
    compiled = g.lower(*jtu.tree_map(_struct, (model, x))).compile()
    (f_model, _), _ = compiled.input_formats
    assert f_model.bias == Format(None, None)
    assert jax.device_put(model.bias, f_model.bias) is model.bias
    placed = eqxs.filter_device_put((model, x), compiled.input_formats[0])
    assert placed[0].bias is model.bias  # left as it is, as `jax.device_put` does
    assert placed[0].weight.format == f_model.weight
    out = compiled(*placed)
    assert jnp.array_equal(out, f(model, x))
    assert jnp.array_equal(g(*placed), f(model, x))
    assert_alive((model, x, placed))


def test_empty_format_is_none_wherever_a_spec_leaf_is():
    # `Format(None, None)` as a spec leaf, a rule's result and a `PathRules` spec.
    empty = Format(None, None)
    x = {"a": jnp.ones(8), "b": jnp.ones(8)}
    s = NamedSharding(auto_mesh(), P("x"))
    for spec in (empty, lambda leaf: empty, eqxs.PathRules([("a", empty)], default=s)):
        out = eqxs.filter_device_put(x, spec)
        assert out["a"] is x["a"]
    out = eqxs.filter_jit(lambda t: t, in_shardings=empty, out_shardings=empty)(x)
    assert jnp.array_equal(out["a"], x["a"])
    assert_alive(x)


def test_auto_flow_with_a_callback_in_the_body():
    # The guarded program of an entry with callbacks runs on arguments placed as the
    # executable wants them (it asked `jax.jit` for `Layout.AUTO` and was refused).
    r = NamedSharding(auto_mesh(), P())
    body = lambda w, x: eqx.error_if(w @ x, jnp.any(jnp.isnan(x)), "nan")
    f = eqxs.filter_jit(body, in_shardings=(Format(Layout.AUTO, r), r))
    w, x = jnp.ones((8, 8)), jnp.arange(8.0)
    compiled = f.lower(_struct(w), _struct(x)).compile()
    placed = eqxs.filter_device_put((w, x), compiled.input_formats[0])
    expected = w @ x
    for out in [compiled(*placed), f(*placed)]:
        assert jnp.array_equal(out, expected)
    with pytest.raises(eqx.EquinoxRuntimeError, match="nan"):
        f(placed[0], eqxs.filter_device_put(jnp.full(8, jnp.nan), r))
    assert_alive((w, x, placed))


@pytest.mark.parametrize("aot", [False, True])
def test_auto_layout_inside_an_outer_trace(aot):
    # As `jax.jit` with the same `in_shardings`: inside an outer `jit` or `grad` the
    # compiler chooses the layout (no executable of ours is called with tracers).
    r = NamedSharding(auto_mesh(), P())
    shardings = (Format(Layout.AUTO, r), r)
    f = eqxs.filter_jit(lambda w, x: w @ x, in_shardings=shardings)
    if aot:
        f.lower(_struct(jnp.ones((8, 8))), _struct(jnp.ones(8))).compile()
    oracle = jax.jit(lambda w, x: w @ x, in_shardings=shardings)
    w, x = jnp.ones((8, 8)), jnp.arange(8.0)
    assert jnp.array_equal(jax.jit(f)(w, x), jax.jit(oracle)(w, x))
    grad = jax.grad(lambda w: f(w, x).sum())(w)
    assert jnp.array_equal(grad, jax.grad(lambda w: oracle(w, x).sum())(w))


@pytest.mark.accelerator
def test_auto_layouts_on_a_chip_as_jax_jit():
    """docs/why.md's flow where it matters: the chip's compiler chooses layouts other
    than the CPU's untiled default (a TPU tiles a float32 matrix `(8, 128)`), and
    `filter_jit` gets exactly the formats, and the values, that `jax.jit` gets on the
    array leaves; one compilation, none at call time."""
    mesh = chip_mesh()
    r, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("x"))
    auto_r, auto_batch = Format(Layout.AUTO, r), Format(Layout.AUTO, batch)
    model = make_module(eqx.nn.MLP, 128, 128, 256, 1)
    key, x = jax.random.key(0), jnp.ones((8 * jax.device_count(), 128))
    step = eqxs.filter_jit(
        _step,
        in_shardings=(auto_r, auto_r, auto_batch, None),
        out_shardings=(r, r, batch, None),
    )
    structs = jtu.tree_map(_struct, (model, key, x))
    with count_compiles() as lowering:
        compiled = step.lower(*structs, "label").compile()
    assert len(lowering) == 1
    formats, _ = compiled.input_formats

    # The oracle: `jax.jit` on the array leaves, with the same shardings.
    leaves, static = eqx.partition((model, key, x), eqx.is_array)
    leaf_specs = (
        jtu.tree_map(lambda _: auto_r, leaves[0]),
        auto_r,
        auto_batch,
    )

    def on_leaves(leaves):
        m, k, a = eqx.combine(leaves, static)
        out = _step(m, k, a, "label")
        return eqx.filter(out[:3], eqx.is_array)

    oracle = jax.jit(on_leaves, in_shardings=(leaf_specs,)).lower(
        jtu.tree_map(_struct, leaves)
    )
    oracle = oracle.compile()
    (oracle_formats,), _ = oracle.input_formats
    ours = [f for f in jtu.tree_leaves(formats[:3]) if isinstance(f, Format)]
    theirs = jtu.tree_leaves(oracle_formats)
    assert len(ours) == len(theirs) > 0
    for a, b in zip(ours, theirs):
        assert isinstance(a.layout, Layout) and a.sharding is not None
        assert a.layout == b.layout, (a, b)
        assert a.sharding.is_equivalent_to(b.sharding, len(a.layout.major_to_minor))
    # What only a chip shows: a tiled layout for a matrix.
    layouts = [f.layout for f in ours if isinstance(f.layout, Layout)]
    assert any(layout.tiling != () for layout in layouts), layouts

    placed = eqxs.filter_device_put((model, key, x, "label"), formats)
    assert placed[2].format == formats[2]
    with count_compiles() as calls:
        out = compiled(*placed)
        again = step(*placed)
    assert len(calls) == 0
    # A key array is placed on its format's sharding (its layout is its key data's).
    is_key = lambda a: jnp.issubdtype(a.dtype, jax.dtypes.prng_key)
    put = lambda a, f: jax.device_put(a, f.sharding if is_key(a) else f)
    expected = oracle(jtu.tree_map(put, leaves, oracle_formats))
    for a, b in zip(
        jtu.tree_leaves(eqx.filter(out[:3], eqx.is_array)), jtu.tree_leaves(expected)
    ):
        assert np.array_equal(_bits(a), _bits(b))
    assert np.array_equal(_bits(again[2]), _bits(out[2]))
    assert out[3] == "label" and out[0].activation is model.activation


def _bits(x):
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x).reshape(-1).view(np.uint8)
