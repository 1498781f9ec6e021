"""What `equinox_shard`'s three functions do in each context: the table of RFC.md §2,
one test per cell group, checked on the mechanism (which primitive is traced, what is
compiled) as well as on the result (the sharding of every array leaf)."""

import equinox as eqx
import equinox_shard as eqxs
import jax
import jax.core
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from .helpers import (
    assert_shardings,
    auto_mesh,
    compiled_names,
    explicit_mesh,
    is_single_device_sharding,
)
from .isolated import child_env, HANG_SECONDS


_MESHES = {"auto": auto_mesh, "explicit": explicit_mesh}
_FUNCTIONS = {
    "filter_device_put": eqxs.filter_device_put,
    "filter_shard": eqxs.filter_shard,
}


def _primitives(fn, *args) -> set[str]:
    return {eqn.primitive.name for eqn in jax.make_jaxpr(fn)(*args).jaxpr.eqns}


def _tree(n=64):
    return {"w": jnp.arange(float(n)), "act": jax.nn.relu, "k": 3}


@pytest.mark.parametrize("fn_name", _FUNCTIONS)
@pytest.mark.parametrize("mesh_name", _MESHES)
def test_outside_trace_is_device_put(fn_name, mesh_name):
    fn = _FUNCTIONS[fn_name]
    s = NamedSharding(_MESHES[mesh_name](), P("x"))
    tree = _tree(24)
    jax.block_until_ready(tree["w"])
    with compiled_names() as names:
        out = fn(tree, s)
    # No identity `jit` (as eager `with_sharding_constraint` compiles); only JAX's own
    # `device_put` helper that splits a single-device array across devices.
    assert set(names) <= {"jit(_multi_slice)"}
    assert_shardings(out["w"], s)
    assert out["act"] is jax.nn.relu and out["k"] == 3
    assert np.array_equal(out["w"], tree["w"])
    with compiled_names() as names:
        again = fn(out, s)
    assert names == []
    assert again["w"] is out["w"]


@pytest.mark.parametrize("fn_name", _FUNCTIONS)
def test_outside_trace_under_set_mesh_with_bare_spec(fn_name):
    mesh = auto_mesh()
    x = jnp.arange(64.0)  # uncommitted (created outside `set_mesh`)
    with jax.set_mesh(mesh):
        out = _FUNCTIONS[fn_name](x, P("x"))
    assert_shardings(out, NamedSharding(mesh, P("x")))


@pytest.mark.parametrize("fn_name", _FUNCTIONS)
@pytest.mark.parametrize("mesh_name", _MESHES)
def test_under_disable_jit_transfers(fn_name, mesh_name):
    s = NamedSharding(_MESHES[mesh_name](), P("x"))
    x = jnp.arange(64.0)
    with jax.disable_jit():
        out = _FUNCTIONS[fn_name]({"w": x, "act": jax.nn.relu}, s)
    assert_shardings(out["w"], s)
    assert out["act"] is jax.nn.relu
    assert not x.committed  # the input is untouched


@pytest.mark.parametrize(
    "fn_name, mesh_name, primitive",
    [
        ("filter_device_put", "auto", "device_put"),
        ("filter_device_put", "explicit", "device_put"),
        ("filter_shard", "auto", "sharding_constraint"),
        ("filter_shard", "explicit", "reshard"),
    ],
)
def test_inside_jit_primitive(fn_name, mesh_name, primitive):
    fn = _FUNCTIONS[fn_name]
    s = NamedSharding(_MESHES[mesh_name](), P("x"))
    x = jax.device_put(jnp.arange(64.0), NamedSharding(s.mesh, P()))
    assert _primitives(lambda a: fn(a * 2, s), x) == {"mul", primitive}


@pytest.mark.parametrize("mesh_name", _MESHES)
def test_inside_jit_effect(mesh_name):
    """`filter_shard` constrains on both kinds of axes; `filter_device_put` on a tracer
    is JAX's `device_put`: no effect on Auto axes, a type change on Explicit axes."""
    s = NamedSharding(_MESHES[mesh_name](), P("x"))
    x = jax.device_put(jnp.arange(64.0), NamedSharding(s.mesh, P()))
    shard = jax.jit(lambda a: eqxs.filter_shard(a * 2, s) + 1)(x)
    put = jax.jit(lambda a: eqxs.filter_device_put(a * 2, s) + 1)(x)
    assert shard.sharding.is_equivalent_to(s, 1)
    if mesh_name == "auto":
        assert put.sharding.is_fully_replicated
    else:
        assert put.sharding.is_equivalent_to(s, 1)
    assert np.array_equal(shard, put)


def test_inside_jit_memory_kind():
    """A non-default memory kind: the constraint (which ignores memory kinds), then
    `device_put` (which honours them but, alone, does not partition on Auto axes)."""
    mesh = auto_mesh()
    host = NamedSharding(mesh, P("x"), memory_kind="pinned_host")
    x = jax.device_put(jnp.arange(64.0), NamedSharding(mesh, P()))
    traced = _primitives(lambda a: eqxs.filter_shard(a, host), x)
    assert traced == {"sharding_constraint", "device_put"}
    out = jax.jit(lambda a: eqxs.filter_shard(a * 2, host))(x)
    assert out.sharding.memory_kind == "pinned_host"
    assert out.sharding.is_equivalent_to(host, 1)
    np.testing.assert_array_equal(out, 2 * np.arange(64.0))


def test_inside_jit_none_is_untouched():
    s = NamedSharding(auto_mesh(), P("x"))
    x = jnp.arange(64.0)
    for fn in _FUNCTIONS.values():
        primitive = "sharding_constraint" if fn is eqxs.filter_shard else "device_put"
        traced = _primitives(lambda a: fn({"a": a, "b": a * 2}, {"a": None, "b": s}), x)
        assert traced == {"mul", primitive}
        out = fn({"a": x, "b": x}, {"a": None, "b": s})
        assert out["a"] is x


@pytest.mark.parametrize("mesh_name", _MESHES)
def test_under_vmap(mesh_name):
    """`filter_shard` under `jax.vmap` constrains the per-example axes and leaves the
    batch axis free; `filter_device_put` is JAX's `device_put`, whose batching rule
    applies the spec to the batched value, i.e. to the batch axis."""
    s = NamedSharding(_MESHES[mesh_name](), P("x"))
    xs = jnp.zeros((8, 64))
    shard = jax.vmap(lambda a: eqxs.filter_shard(a, s))(xs)
    put = jax.vmap(lambda a: eqxs.filter_device_put(a, s))(xs)
    assert shard.sharding.is_equivalent_to(NamedSharding(s.mesh, P(None, "x")), 2)
    assert put.sharding.is_equivalent_to(NamedSharding(s.mesh, P("x", None)), 2)


@pytest.mark.parametrize("mesh_name", _MESHES)
def test_under_grad(mesh_name):
    """Auto axes: the cotangent gets its own `with_sharding_constraint`, so the
    gradient comes out sharded like the constraint. Explicit axes: `reshard`'s
    transpose reshards the cotangent back, so the gradient has the input's type."""
    s = NamedSharding(_MESHES[mesh_name](), P("x"))
    r = NamedSharding(s.mesh, P())
    x = jax.device_put(jnp.arange(64.0), r)
    g = jax.jit(jax.grad(lambda a: jnp.sum(eqxs.filter_shard(a, s) ** 2)))(x)
    assert g.sharding.is_equivalent_to(s if mesh_name == "auto" else r, 1)
    np.testing.assert_allclose(g, 2 * np.arange(64.0))


@pytest.mark.parametrize("fn_name", _FUNCTIONS)
@pytest.mark.parametrize("mesh_name", _MESHES)
def test_under_eval_shape(fn_name, mesh_name):
    s = NamedSharding(_MESHES[mesh_name](), P("x"))
    x = jnp.arange(64.0)
    out = eqx.filter_eval_shape(lambda t: _FUNCTIONS[fn_name](t, s), {"w": x, "k": 3})
    assert isinstance(out["w"], jax.ShapeDtypeStruct)
    assert out["k"] == 3
    if mesh_name == "auto":
        assert out["w"].sharding is None
    else:
        assert out["w"].sharding.spec == P("x")
    assert not x.committed


#
# `filter_jit` in each context.
#


@pytest.mark.parametrize(
    "mesh_name",
    [
        "auto",
        pytest.param(
            "explicit",
            marks=pytest.mark.xfail(
                strict=True,
                reason="as `jax.jit(out_shardings=...)` nested in `jax.jit` on "
                "Explicit axes (JAX 0.10.2): the outer result comes back P(None)",
            ),
        ),
    ],
)
@pytest.mark.devices(2, reason="P('x') and P() are the same sharding on one device")
def test_filter_jit_nested_in_jit_constrains_outputs(mesh_name):
    s = NamedSharding(_MESHES[mesh_name](), P("x"))
    r = NamedSharding(s.mesh, P())
    inner = eqxs.filter_jit(lambda a: a * 2, in_shardings=r, out_shardings=s)
    x = jax.device_put(jnp.arange(64.0), r)
    out = jax.jit(lambda a: inner(a) + 1)(x)
    assert out.sharding.is_equivalent_to(s, 1)
    np.testing.assert_array_equal(out, 2 * np.arange(64.0) + 1)


@pytest.mark.parametrize("mesh_name", _MESHES)
def test_filter_jit_under_disable_jit_places(mesh_name):
    s = NamedSharding(_MESHES[mesh_name](), P("x"))
    seen = []

    def f(a, k):
        seen.append(a.sharding)
        return a * k, "static"

    g = eqxs.filter_jit(f, in_shardings=s, out_shardings=s)
    with jax.disable_jit():
        out, tag = g(jnp.arange(64.0), 2)
    assert seen[0].is_equivalent_to(s, 1)
    assert_shardings(out, s)
    assert tag == "static"


@pytest.mark.parametrize("mesh_name", _MESHES)
def test_filter_jit_out_shardings_matches_jax_jit(mesh_name):
    """`out_shardings` is applied as a constraint inside the traced function; the
    result carries the same sharding as `jax.jit(..., out_shardings=...)` gives."""
    mesh = _MESHES[mesh_name]()
    target = NamedSharding(mesh, P(None, "x"))
    x = jax.device_put(
        jnp.arange(256.0).reshape(16, 16), NamedSharding(mesh, P("x", None))
    )

    def body(a):
        return jnp.sin(a) * 2 + a

    ours = eqxs.filter_jit(body, out_shardings=target)(x)
    theirs = jax.jit(body, out_shardings=target)(x)
    assert ours.sharding.is_equivalent_to(theirs.sharding, 2)
    assert ours.sharding.is_equivalent_to(target, 2)
    np.testing.assert_array_equal(ours, theirs)


def test_filter_jit_out_shardings_memory_kind():
    mesh = auto_mesh()
    host = NamedSharding(mesh, P(), memory_kind="pinned_host")
    x = jax.device_put(jnp.arange(64.0), NamedSharding(mesh, P()))
    out = eqxs.filter_jit(lambda a: a * 2, out_shardings=host)(x)
    assert out.sharding.memory_kind == "pinned_host"


@pytest.mark.devices(8, reason="a dimension size that 8 devices do not divide")
def test_filter_jit_out_shardings_indivisible_raises():
    s = NamedSharding(auto_mesh(), P("x"))
    with pytest.raises(ValueError, match=r"out: dimension 0 .* not divisible"):
        eqxs.filter_jit(lambda a: a * 2, out_shardings=s)(jnp.arange(10.0))


@pytest.mark.devices(2, reason="P('x') and P() are the same sharding on one device")
def test_filter_jit_arrays_created_under_set_mesh_are_moved():
    """Arrays created under `jax.set_mesh` are committed (replicated). `jax.jit` refuses
    them under `in_shardings=P("x")`; `filter_jit` moves them (a copy), as it moves
    arrays created outside the mesh context."""
    mesh = auto_mesh()
    outside = jnp.arange(64.0)
    f = eqxs.filter_jit(lambda a: a * 2, in_shardings=P("x"))
    with jax.set_mesh(mesh):
        inside = jnp.arange(64.0)
        assert inside.committed
        with pytest.raises(ValueError, match="does not match the sharding"):
            jax.jit(lambda a: a * 2, in_shardings=P("x"))(inside)
        results = [f(inside), f(outside), f(eqxs.filter_device_put(inside, P("x")))]
    for y in results:
        assert_shardings(y, NamedSharding(mesh, P("x")))
        assert np.array_equal(np.asarray(y), 2 * np.arange(64.0, dtype=np.float32))
    assert inside.sharding.is_equivalent_to(NamedSharding(mesh, P()), 1)


def test_filter_jit_keyword_only_parameters_unspecified_by_tuple():
    mesh = auto_mesh()
    s = NamedSharding(mesh, P("x"))

    def f(a, *, b):
        return a + b, b

    g = eqxs.filter_jit(f, in_shardings=(s,))
    b = jax.device_put(jnp.arange(64.0), NamedSharding(mesh, P()))
    out, b_out = g(jnp.arange(64.0), b=b)
    assert_shardings(b_out, NamedSharding(mesh, P()))  # `b` kept its own sharding
    np.testing.assert_array_equal(out, 2 * np.arange(64.0))
    # The single-leaf form covers keyword-only parameters too.
    h = eqxs.filter_jit(lambda a, *, b: b, in_shardings=s)
    assert_shardings(h(jnp.arange(64.0), b=jnp.arange(64.0)), s)


def test_module_placement_non_arrays_untouched(getkey):
    mesh = auto_mesh()
    model = eqx.nn.MLP(8, 8, 16, 1, key=getkey())
    r = NamedSharding(mesh, P())
    for fn in _FUNCTIONS.values():
        out = fn(model, r)
        assert out.activation is model.activation
        assert_shardings(out, r)
        assert eqx.tree_equal(out, model)
    keys = jr.split(jr.key(0), 64)
    placed = eqxs.filter_shard(keys, NamedSharding(mesh, P("x")))
    assert_shardings(placed, NamedSharding(mesh, P("x")))
    assert is_single_device_sharding(jnp.arange(1).sharding)


#
# Spec language and donation details quoted in RFC.md §4–§7.
#


def test_if_array_specs_work_as_callables():
    """Equinox's `if_array(spec)` (the `AxisSpec` idiom of #1077) is a callable spec
    leaf: called on array leaves only, it returns the spec. (Its annotation says
    `axis: int`, so Equinox's own runtime type checks reject it; see RFC §5.)"""
    if getattr(eqx.if_array.__init__, "__wrapped__", None) is not None:
        pytest.skip("eqx.if_array is runtime type-checked (axis: int)")
    mesh = auto_mesh()
    s, r = NamedSharding(mesh, P("x")), NamedSharding(mesh, P())
    f = eqxs.filter_jit(
        lambda a, b: (a, b),
        in_shardings=(eqx.if_array(s), eqx.if_array(r)),  # pyright: ignore[reportArgumentType]
    )
    a, b = f(jnp.arange(64.0), {"k": jnp.arange(8.0), "n": 3})
    assert_shardings((a, b["k"]), (s, r))
    assert b["n"] == 3


def test_layouts_are_spec_leaves_auto_is_for_the_compiler():
    """RFC §4: a `Format` is a spec leaf; `Layout.AUTO` cannot place an array (only a
    compiler chooses it), and the error names the leaf and says to lower first."""
    from jax.experimental.layout import Format, Layout

    s = NamedSharding(auto_mesh(), P("x"))
    with pytest.raises(ValueError, match=r"^x: .*Layout.AUTO.*input_formats"):
        eqxs.filter_device_put(jnp.arange(64.0), Format(Layout.AUTO, s))
    out = eqxs.filter_device_put(jnp.arange(64.0), Format(None, s))
    assert out.sharding == s


@pytest.mark.devices(2, reason="one device's uncommitted array is in place: donated")
def test_donated_uncommitted_input_is_copied_not_deleted():
    """An uncommitted argument with a specified `in_shardings` entry is committed (a
    copy) before the call; the copy is what is donated."""
    s = NamedSharding(auto_mesh(), P("x"))
    x = jnp.arange(64.0)
    y = jax.device_put(jnp.arange(64.0), s)
    f = eqxs.filter_jit(lambda a: a + 1, in_shardings=s, donate="all")
    out = f(x)
    assert not x.is_deleted()
    f(y)
    assert y.is_deleted()
    np.testing.assert_array_equal(out, np.arange(64.0) + 1)


@pytest.mark.devices(2, reason="P('x') and P() are the same sharding on one device")
def test_donated_input_without_matching_output_is_not_deleted():
    mesh = auto_mesh()
    y = jax.device_put(jnp.arange(64.0), NamedSharding(mesh, P("x")))
    out = eqxs.filter_jit(
        lambda a: a + 1, out_shardings=NamedSharding(mesh, P()), donate="all"
    )(y)
    assert not y.is_deleted()  # the output's shards have another shape
    assert_shardings(out, NamedSharding(mesh, P()))


_FDP_DONATE_TO_DEVICE = """
import jax
jax.config.update("jax_num_cpu_devices", 8)
import jax.numpy as jnp
import equinox_shard as eqxs
x = jax.device_put(jnp.arange(64.0), jax.devices()[1])
y = eqxs.filter_device_put({"w": x}, jax.devices()[2], donate=True)
print(float(jnp.sum(y["w"])), x.is_deleted(), flush=True)
"""


@pytest.mark.slow
def test_filter_device_put_donate_to_another_device():
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", _FDP_DONATE_TO_DEVICE],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=HANG_SECONDS,
    )
    assert result.returncode == 0, result.returncode
    assert result.stdout.strip() in ("2016.0 False", "2016.0 True")


def test_filter_jit_rules_are_called_once_per_compilation():
    """A callable spec in `filter_jit` is called when a new entry is compiled (on the
    concrete argument for `in_shardings`, on the tracer for `out_shardings`), not on
    every call: its result may depend on shape and dtype, not on values."""
    s = NamedSharding(auto_mesh(), P("x"))
    calls = []

    def rule(leaf):
        calls.append(isinstance(leaf, jax.core.Tracer))  # pyright: ignore
        return s

    f = eqxs.filter_jit(lambda a: a * 2, in_shardings=rule, out_shardings=rule)
    x = jax.device_put(jnp.arange(64.0), s)
    for _ in range(3):
        assert_shardings(f(x), s)
    assert calls == [False, True]
    f(jax.device_put(jnp.arange(128.0), s))  # a new shape: a new compilation
    assert calls == [False, True, False, True]


def test_filter_jit_in_shardings_checked_at_decoration():
    s = NamedSharding(auto_mesh(), P())

    def f(a, b):
        return a + b

    with pytest.raises(ValueError, match="one entry per positional parameter"):
        eqxs.filter_jit(f, in_shardings=(s,))
    with pytest.raises(ValueError, match=r"names 'c'.*wrap it in a tuple"):
        eqxs.filter_jit(f, in_shardings={"c": s})


_FUNCTION_ARRAY_PASSED_AGAIN = """
import sys
import jax
jax.config.update("jax_num_cpu_devices", 8)
import equinox as eqx
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import equinox_shard as eqxs


class Scale(eqx.Module):
    w: jax.Array

    def __call__(self, x):
        return self.w * x


mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
scale = Scale(jax.device_put(jnp.arange(64.0), NamedSharding(mesh, P("x"))))
try:
    out = eqxs.filter_jit(scale, donate=sys.argv[1])(scale.w)
    print("ok", float(out.sum()), scale.w.is_deleted(), flush=True)
except ValueError as e:
    print("ValueError", str(e).split(":")[0], scale.w.is_deleted(), flush=True)
"""


def _function_array_passed_again(mode):
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", _FUNCTION_ARRAY_PASSED_AGAIN, mode],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=HANG_SECONDS,
    )
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    return result.stdout.split()


@pytest.mark.slow
def test_filter_jit_function_array_donated_and_passed_raises():
    """A Module used as the function has its arrays donated under `"all"`; passing
    one of them again raises, naming the argument, and deletes nothing (plain
    `jax.jit`, and `eqx.filter_jit`, crash on this)."""
    assert _function_array_passed_again("all") == ["ValueError", "x", "False"]


@pytest.mark.slow
def test_filter_jit_function_array_donated_and_passed_as_first():
    assert _function_array_passed_again("all-except-first")[0] in ("ok", "ValueError")


@pytest.mark.devices(2, reason="one device's uncommitted array is in place: donated")
def test_donation_deletes_only_inputs_reused_for_outputs():
    """Each output reuses at most one donated input buffer with its shard shape and
    dtype, taken in argument order; donated inputs left over are not deleted. The
    committed copy of an uncommitted argument competes for those slots too."""
    s = NamedSharding(auto_mesh(), P("x"))

    @eqxs.filter_jit(donate="all", in_shardings=s, out_shardings=s)
    def one(a, b):
        return a + b

    @eqxs.filter_jit(donate="all", in_shardings=s, out_shardings=s)
    def two(a, b):
        return a + b, a - b

    def committed():
        return jax.device_put(jnp.ones(16), s)

    a, b = jnp.arange(16.0), committed()
    jax.block_until_ready(one(a, b))
    assert (a.is_deleted(), b.is_deleted()) == (False, False)  # a's copy was reused
    b, a = committed(), jnp.arange(16.0)
    jax.block_until_ready(one(b, a))
    assert (b.is_deleted(), a.is_deleted()) == (True, False)
    b1, b2 = committed(), committed()
    jax.block_until_ready(one(b1, b2))
    assert (b1.is_deleted(), b2.is_deleted()) == (True, False)
    a, b = jnp.arange(16.0), committed()
    out = jax.block_until_ready(two(a, b))
    assert (a.is_deleted(), b.is_deleted()) == (False, True)
    np.testing.assert_array_equal(out[0], np.arange(16.0) + 1)
