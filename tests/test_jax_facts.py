"""Pins down the behaviour of JAX (and of today's Equinox) that RFC.md relies on.

Nothing here tests `equinox_shard`: each test states one fact about `jax` or `equinox`
on the versions in use, so that a change upstream shows up as a failing test with the
RFC section it invalidates. RFC.md names these tests next to each claim.

Each test asserts the behaviour of the JAX in use. Where a fact differs between the
releases we test (0.10.2, the oldest supported, and 0.12, the newest), the test branches
on `jax_at_least` and RFC.md shows both. A test that fails says which RFC section to
re-check on which JAX: update the section and add a branch here, keeping the old one.
"""

import functools as ft
import re
import subprocess
import sys
import textwrap
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.sharding as jshard
import numpy as np
import pytest
from jax._src.sharding import IndivisibleError
from jax.experimental.layout import Format, Layout
from jax.sharding import NamedSharding, PartitionSpec as P

from .helpers import (
    auto_mesh,
    compiled_names,
    explicit_mesh,
    is_single_device_sharding,
)
from .isolated import child_env, HANG_SECONDS


def jax_at_least(version: str) -> bool:
    """Whether the JAX in use is `version` or newer (release numbers only)."""

    def parse(text):
        return tuple(int(part) for part in re.findall(r"\d+", text)[:3])

    return parse(jax.__version__) >= parse(version)


def rfc(section: str):
    """Marks a test as the evidence for `section` of RFC.md, so that its failure says
    which claim a new JAX (or Equinox) has broken."""

    def decorate(test):
        @ft.wraps(test)
        def wrapper(*args, **kwargs):
            try:
                return test(*args, **kwargs)
            except (Exception, pytest.fail.Exception) as error:
                raise AssertionError(
                    f"JAX {jax.__version__} / Equinox {eqx.__version__} no longer "
                    f"behaves as RFC.md {section} says ({test.__name__}). Re-check "
                    f"RFC.md {section} on this version, then add a branch on "
                    f"`jax_at_least` here, keeping the old behaviour's. Original "
                    f"failure: {type(error).__name__}: {error}"
                ) from error

        return wrapper

    return decorate


def _buffers(x):
    return {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}


def _uncommitted(n=64):
    x = jnp.arange(float(n))
    assert not x.committed
    return x


#
# RFC §1: eager `with_sharding_constraint` vs `device_put`.
#


@rfc("§1")
def test_make_mesh_defaults_to_explicit():
    mesh = jax.make_mesh((jax.device_count(),), ("x",))
    assert mesh.axis_types == (jshard.AxisType.Explicit,)
    assert jshard.Mesh(np.array(jax.devices()), ("x",)).axis_types == (
        jshard.AxisType.Auto,
    )


@rfc("§1")
def test_eager_wsc_compiles_identity_jit():
    s = NamedSharding(auto_mesh(), P("x"))
    x = _uncommitted(40)
    with compiled_names() as first:
        y = jax.lax.with_sharding_constraint(x, s)
    assert "jit(_identity_fn)" in first
    assert y.committed and y.sharding == s
    # The input's sharding is part of the cache key: an already-placed input compiles
    # its own identity function once, then nothing.
    with compiled_names() as second:
        jax.lax.with_sharding_constraint(y, s)
    assert second == ["jit(_identity_fn)"]
    with compiled_names() as third:
        jax.lax.with_sharding_constraint(y, NamedSharding(auto_mesh(), P("x")))
    assert third == []


@rfc("§1")
def test_eager_wsc_copies():
    s = NamedSharding(auto_mesh(), P("x"))
    y = jax.device_put(_uncommitted(), s)
    z = jax.lax.with_sharding_constraint(y, s)
    assert z is not y
    assert z.sharding == s
    assert _buffers(z).isdisjoint(_buffers(y))
    assert np.array_equal(z, y)


@rfc("§1")
def test_device_put_returns_same_object_when_placed():
    mesh = auto_mesh()
    s = NamedSharding(mesh, P("x"))
    y = jax.device_put(_uncommitted(), s)
    assert jax.device_put(y, s) is y
    assert jax.device_put(y, NamedSharding(mesh, P("x"))) is y  # equal, new object
    copied = jax.device_put(y, s, may_alias=False)
    assert copied is not y and _buffers(copied).isdisjoint(_buffers(y))
    # Equivalent but not equal (P() vs P(None)): a new object over the same buffers.
    r = jax.device_put(_uncommitted(), NamedSharding(mesh, P()))
    r2 = jax.device_put(r, NamedSharding(mesh, P(None)))
    assert r2 is not r and _buffers(r2) == _buffers(r)


@rfc("§1")
@pytest.mark.devices(2, reason="a split over one device compiles nothing")
def test_device_put_compiles_only_to_split_a_single_device_array():
    mesh = auto_mesh()
    s = NamedSharding(mesh, P("x"))
    x = _uncommitted(24)
    r = jax.device_put(_uncommitted(32), NamedSharding(mesh, P()))
    n = np.arange(16.0)
    jax.block_until_ready((x, r))
    with compiled_names() as names:
        jax.device_put(r, s)  # replicated -> sharded
        jax.device_put(n, s)  # NumPy -> sharded
        jax.device_put(x, NamedSharding(mesh, P()))  # one device -> replicated
    assert names == []
    with compiled_names() as names:
        jax.device_put(x, s)  # one device -> sharded: slices with a jitted helper
    assert names == ["jit(_multi_slice)"]
    with compiled_names() as names:
        jax.device_put(_uncommitted(24) + 1, s)  # same shape again: cached
    assert "jit(_multi_slice)" not in names


@rfc("§1")
def test_eager_wsc_noop_under_disable_jit():
    s = NamedSharding(auto_mesh(), P("x"))
    x = _uncommitted()
    indivisible = _uncommitted(10)
    with jax.disable_jit():
        assert jax.lax.with_sharding_constraint(x, s) is x
        # Not even validated.
        assert jax.lax.with_sharding_constraint(indivisible, s) is indivisible
    assert not x.committed
    assert is_single_device_sharding(x.sharding)


@rfc("§1")
def test_device_put_and_reshard_apply_under_disable_jit():
    s = NamedSharding(auto_mesh(), P("x"))
    e = NamedSharding(explicit_mesh(), P("x"))
    with jax.disable_jit():
        y = jax.device_put(_uncommitted(), s)
        z = jax.sharding.reshard(_uncommitted(), e)
    assert y.committed and y.sharding == s
    assert z.committed and z.sharding == e


@rfc("§1")
def test_eager_wsc_raises_on_explicit_axes():
    e = NamedSharding(explicit_mesh(), P("x"))
    with pytest.raises(ValueError, match="can only refer to Auto axes"):
        jax.lax.with_sharding_constraint(_uncommitted(), e)
    with pytest.raises(ValueError, match="can only refer to Auto axes"):
        jax.jit(lambda a: jax.lax.with_sharding_constraint(a, e))(_uncommitted())


@rfc("§1")
def test_wsc_is_an_assert_under_explicit_set_mesh():
    mesh = explicit_mesh()
    y = jax.device_put(_uncommitted(), NamedSharding(mesh, P("x")))
    with jax.set_mesh(mesh):
        assert jax.lax.with_sharding_constraint(y, P("x")) is y
        with pytest.raises(AssertionError, match="acts as an assert"):
            jax.lax.with_sharding_constraint(y, P())


@rfc("§1")
def test_reshard_rejects_auto_axes():
    s = NamedSharding(auto_mesh(), P("x"))
    with pytest.raises(ValueError, match="cannot contain axis names that are of type"):
        jax.sharding.reshard(_uncommitted(), s)


@rfc("§1")
def test_eager_wsc_bare_pspec_uncommitted_raises():
    mesh = auto_mesh()
    x = _uncommitted()  # Created outside `set_mesh`; see the next test.
    with jax.set_mesh(mesh):
        with pytest.raises(TypeError, match="must be a `NamedSharding`"):
            jax.lax.with_sharding_constraint(x, P("x"))
        # `device_put` takes the same bare spec, and so does wsc on a committed input.
        y = jax.device_put(x, P("x"))
        assert y.sharding.is_equivalent_to(NamedSharding(mesh, P("x")), 1)
        z = jax.lax.with_sharding_constraint(y, P("x"))
        assert z.sharding.is_equivalent_to(NamedSharding(mesh, P("x")), 1)


@pytest.mark.parametrize("make_mesh", [auto_mesh, explicit_mesh])
@rfc("§1")
def test_set_mesh_commits_new_arrays(make_mesh):
    """Under `jax.set_mesh`, arrays created eagerly are committed, replicated over the
    mesh: "uncommitted" inputs are what you get *outside* a mesh context."""
    mesh = make_mesh()
    with jax.set_mesh(mesh):
        x = jnp.arange(64.0)
        y = jax.jit(lambda: jnp.zeros(64))()
    for a in (x, y):
        assert a.committed
        assert a.sharding.is_equivalent_to(NamedSharding(mesh, P()), 1)


@rfc("§1")
def test_bare_pspec_without_mesh_raises():
    with pytest.raises(ValueError, match="set a mesh"):
        jax.device_put(_uncommitted(), P("x"))
    with pytest.raises(RuntimeError, match="non-empty mesh"):
        jax.jit(lambda a: a, in_shardings=P("x"))(_uncommitted())


@rfc("§1")
def test_placed_arrays_are_committed_and_arrive_sharded():
    """Why today's eager `eqx.filter_shard` "works": it returns committed arrays,
    and `jax.jit` with unspecified `in_shardings` compiles for a committed argument's
    sharding. An uncommitted argument is placed by `jax.jit` on one device."""
    s = NamedSharding(auto_mesh(), P("x"))
    placed = eqx.filter_shard(_uncommitted(), s)
    assert placed.committed and placed.sharding == s
    f = jax.jit(lambda a: a * 2)
    assert f(placed).sharding == s
    assert f.lower(placed).compile().input_shardings[0][0] == s
    out = f(_uncommitted())
    assert not out.committed and is_single_device_sharding(out.sharding)


@rfc("§1")
def test_eqx_filter_shard_today():
    """Today's `eqx.filter_shard`: a copy eagerly, nothing under `disable_jit`, an
    error on Explicit axes and on a bare PartitionSpec for an uncommitted array."""
    s = NamedSharding(auto_mesh(), P("x"))
    y = jax.device_put(_uncommitted(), s)
    assert eqx.filter_shard(y, s) is not y
    x = _uncommitted()
    with jax.disable_jit():
        assert eqx.filter_shard(x, s) is x
    assert not x.committed
    with pytest.raises(ValueError, match="can only refer to Auto axes"):
        eqx.filter_shard(_uncommitted(), NamedSharding(explicit_mesh(), P("x")))
    x = _uncommitted()
    with jax.set_mesh(auto_mesh()):
        with pytest.raises(TypeError, match="must be a `NamedSharding`"):
            eqx.filter_shard(x, P("x"))


@rfc("§1")
def test_eqx_filter_jit_rejects_shardings():
    with pytest.raises(ValueError, match="in_shardings"):
        eqx.filter_jit(lambda a: a, in_shardings=None)  # pyright: ignore[reportCallIssue]
    with pytest.raises(ValueError, match="out_shardings"):
        eqx.filter_jit(lambda a: a, out_shardings=None)  # pyright: ignore[reportCallIssue]


#
# RFC §2: inside a trace.
#


@rfc("§2")
@pytest.mark.devices(2, reason="P('x') and P() are the same sharding on one device")
def test_device_put_on_tracer_does_not_constrain_auto_axes():
    s = NamedSharding(auto_mesh(), P("x"))
    x = _uncommitted()
    put = jax.jit(lambda a: jax.device_put(a * 2, s) + 1)
    constrained = jax.jit(lambda a: jax.lax.with_sharding_constraint(a * 2, s) + 1)
    assert "device_put" in str(jax.make_jaxpr(put)(x))
    out_put = put(x)
    out_constrained = constrained(x)
    assert not out_put.sharding.is_equivalent_to(s, 1)
    assert out_put.sharding.is_fully_replicated
    assert out_constrained.sharding.is_equivalent_to(s, 1)
    assert np.array_equal(out_put, out_constrained)


@rfc("§2")
def test_device_put_on_tracer_changes_type_on_explicit_axes():
    e = NamedSharding(explicit_mesh(), P("x"))
    x = jax.device_put(_uncommitted(), NamedSharding(explicit_mesh(), P()))
    out = jax.jit(lambda a: jax.device_put(a * 2, e) + 1)(x)
    assert out.sharding.is_equivalent_to(e, 1)
    assert jax.typeof(out).sharding.spec == P("x")


@rfc("§2")
@pytest.mark.devices(2, reason="one device divides every dimension size")
def test_device_put_under_vmap_applies_spec_to_batch_axis():
    """`device_put`'s batching rule passes the sharding through unchanged, so under
    `jax.vmap` the spec lands on the batched value, whose leading axis is the batch."""
    s = NamedSharding(auto_mesh(), P("x"))
    out = jax.vmap(lambda a: jax.device_put(a, s))(jnp.zeros((8, 64)))
    assert out.sharding.is_equivalent_to(NamedSharding(s.mesh, P("x", None)), 2)
    e = NamedSharding(explicit_mesh(), P("x"))
    with pytest.raises(ValueError, match="dimension size 3"):
        jax.vmap(lambda a: jax.device_put(a, e))(jnp.zeros((3, 64)))


@rfc("§2")
def test_wsc_under_vmap_leaves_batch_axis_unconstrained():
    mesh = auto_mesh((2, 4), ("b", "m"))
    s = NamedSharding(mesh, P("m"))
    x = jax.device_put(jnp.zeros((4, 8)), NamedSharding(mesh, P()))

    def row(a):
        return jax.lax.with_sharding_constraint(a * 2, s)

    plain = jax.jit(jax.vmap(row))(x)
    named = jax.jit(jax.vmap(row, spmd_axis_name="b"))(x)
    assert plain.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "m")), 2)
    assert named.sharding.is_equivalent_to(NamedSharding(mesh, P("b", "m")), 2)


@rfc("§2")
def test_wsc_under_grad_constrains_cotangent():
    s = NamedSharding(auto_mesh(), P("x"))
    x = jax.device_put(_uncommitted(), NamedSharding(auto_mesh(), P()))
    g = jax.jit(jax.grad(lambda a: jnp.sum(jax.lax.with_sharding_constraint(a, s))))
    assert "sharding_constraint" in str(jax.make_jaxpr(g)(x))
    assert g(x).sharding.is_equivalent_to(s, 1)


@rfc("§2")
def test_eval_shape_sharding_auto_vs_explicit():
    a = NamedSharding(auto_mesh(), P("x"))
    e = NamedSharding(explicit_mesh(), P("x"))
    x_a = _uncommitted()
    out_a = jax.eval_shape(lambda v: jax.lax.with_sharding_constraint(v, a), x_a)
    x_e = jax.device_put(_uncommitted(), NamedSharding(explicit_mesh(), P()))
    out_e = jax.eval_shape(lambda v: jax.sharding.reshard(v, e), x_e)
    assert out_a.sharding is None
    assert isinstance(out_e.sharding, NamedSharding)  # over an AbstractMesh
    assert out_e.sharding.spec == P("x")


#
# RFC §3: `out_shardings` vs a constraint on the returned value.
#


def _body(a):
    return jnp.sin(a) * 2 + a


@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
@rfc("§3")
@pytest.mark.devices(2, reason="P('x') and P() are the same sharding on one device")
def test_out_shardings_vs_constraint_same_output(axis_type):
    mesh = auto_mesh() if axis_type == "auto" else explicit_mesh()
    target = NamedSharding(mesh, P(None, "x"))
    constrain = (
        jax.lax.with_sharding_constraint
        if axis_type == "auto"
        else jax.sharding.reshard
    )
    x = jax.device_put(
        jnp.arange(256.0).reshape(16, 16) / 256, NamedSharding(mesh, P("x", None))
    )
    by_out = jax.jit(_body, out_shardings=target)
    by_constraint = jax.jit(lambda a: constrain(_body(a), target))
    unconstrained = jax.jit(_body)
    c_out = by_out.lower(x).compile()
    c_con = by_constraint.lower(x).compile()
    c_none = unconstrained.lower(x).compile()
    assert c_out.output_shardings.is_equivalent_to(target, 2)
    assert c_con.output_shardings.is_equivalent_to(target, 2)
    # Without either, propagation picks something else: the constraint is not moot.
    assert not c_none.output_shardings.is_equivalent_to(target, 2)
    y_out, y_con = by_out(x), by_constraint(x)
    assert y_out.sharding.is_equivalent_to(target, 2)
    assert y_con.sharding.is_equivalent_to(target, 2)
    assert np.array_equal(y_out, y_con)
    np.testing.assert_allclose(y_out, _body(np.asarray(x)), rtol=1e-5)


@rfc("§3")
def test_out_shardings_vs_constraint_nested():
    """Nested in an outer `jax.jit`, both still constrain the inner result."""
    mesh = auto_mesh()
    target = NamedSharding(mesh, P(None, "x"))
    x = jax.device_put(
        jnp.arange(256.0).reshape(16, 16) / 256, NamedSharding(mesh, P("x", None))
    )
    inner_out = jax.jit(_body, out_shardings=target)
    inner_con = jax.jit(lambda a: jax.lax.with_sharding_constraint(_body(a), target))
    for inner in (inner_out, inner_con):
        out = jax.jit(lambda a: inner(a))(x)
        assert out.sharding.is_equivalent_to(target, 2)


@rfc("§3")
def test_out_shardings_vs_constraint_memory_kind():
    """Where they differ: `with_sharding_constraint` ignores a memory kind,
    `out_shardings` (and `device_put` inside jit) honour it."""
    mesh = auto_mesh()
    host = NamedSharding(mesh, P(), memory_kind="pinned_host")
    x = jax.device_put(_uncommitted(), NamedSharding(mesh, P()))
    by_out = jax.jit(lambda a: a * 2, out_shardings=host)(x)
    by_wsc = jax.jit(lambda a: jax.lax.with_sharding_constraint(a * 2, host))(x)
    by_put = jax.jit(lambda a: jax.device_put(a * 2, host))(x)
    assert by_out.sharding.memory_kind == "pinned_host"
    assert by_put.sharding.memory_kind == "pinned_host"
    assert by_wsc.sharding.memory_kind == "device"


@rfc("§3")
@pytest.mark.devices(8, reason="sizes that 8 devices do not divide")
def test_out_shardings_vs_constraint_indivisible():
    """Where they differ: `out_shardings` raises on a dimension that the mesh axis does
    not divide. A constraint is accepted and dropped inside jit on JAX 0.10.2; on JAX
    0.12 only when the size shares no factor with the axis: otherwise the compiler
    splits it as far as it divides, and JAX fails to name the result."""
    s = NamedSharding(auto_mesh(), P("x"))

    def constrained(a):
        return jax.lax.with_sharding_constraint(a * 2, s)

    coprime = jax.jit(constrained)(_uncommitted(7))
    assert coprime.sharding.is_fully_replicated
    if jax_at_least("0.12"):
        # 10 = 2 x 5 over 8 devices: tiled 2 ways, replicated 4 ways.
        with pytest.raises(IndivisibleError, match="not divisible by axis_size=8"):
            jax.jit(constrained)(_uncommitted(10))
    else:
        out = jax.jit(constrained)(_uncommitted(10))
        assert out.sharding.is_fully_replicated
    for n in (7, 10):
        with pytest.raises(ValueError, match="divide"):
            jax.jit(lambda a: a * 2, out_shardings=s)(_uncommitted(n))


@rfc("§3")
@pytest.mark.devices(2, reason="on one device P('x') is P(): the donation is usable")
def test_out_shardings_vs_constraint_donation_warning():
    """Where they differ: only `out_shardings` lets JAX see, before compiling, that a
    donated input cannot be reused, and warn. Neither deletes the input."""
    mesh = auto_mesh()
    s, r = NamedSharding(mesh, P("x")), NamedSharding(mesh, P())
    y = jax.device_put(_uncommitted(), s)
    with pytest.warns(UserWarning, match="Some donated buffers were not usable"):
        jax.jit(lambda a: a + 1, out_shardings=r, donate_argnums=0)(y)
    assert not y.is_deleted()
    constrained = jax.jit(
        lambda a: jax.lax.with_sharding_constraint(a + 1, r), donate_argnums=0
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = constrained(y)
    assert not y.is_deleted()
    assert out.sharding.is_equivalent_to(r, 1)


@rfc("§3")
def test_jit_shardings_ignored_under_disable_jit():
    s = NamedSharding(auto_mesh(), P("x"))
    seen = []

    def f(a):
        seen.append(a)
        return a

    committed = jax.device_put(_uncommitted(), NamedSharding(s.mesh, P()))
    with jax.disable_jit():
        out = jax.jit(f, in_shardings=s, out_shardings=s)(committed)  # no mismatch
        scalar = jax.jit(f, in_shardings=s)(2.0)
    assert out is committed
    assert seen[0] is committed
    assert type(scalar) is float


@rfc("§3")
def test_out_shardings_rejects_unconstrained():
    mesh = auto_mesh((2, 4), ("a", "b"))
    spec = NamedSharding(mesh, P("a", P.UNCONSTRAINED))
    x = jax.device_put(jnp.zeros((8, 8)), NamedSharding(mesh, P()))
    out = jax.jit(lambda v: jax.lax.with_sharding_constraint(v * 2, spec))(x)
    assert out.shape == (8, 8)
    with pytest.raises(ValueError, match="Unconstrained dims are not allowed"):
        jax.jit(lambda v: v * 2, out_shardings=spec)(x)


#
# RFC §4: letting the compiler choose.
#


@rfc("§4")
def test_jit_unspecified_follows_committed_inputs():
    """With `in_shardings` unspecified, `jax.jit` accepts any committed sharding and
    compiles once per distinct input sharding; an uncommitted input is placed by
    jit on one device."""
    mesh = auto_mesh((8, 1), ("x", "y"))
    traces = []

    def f(a):
        traces.append(None)
        return a + 1

    jf = jax.jit(f)
    by_rows = jax.device_put(jnp.zeros((8, 8)), NamedSharding(mesh, P("x")))
    by_cols = jax.device_put(jnp.zeros((8, 8)), NamedSharding(mesh, P(None, "x")))
    assert jf(by_rows).sharding.is_equivalent_to(by_rows.sharding, 2)
    assert jf(by_cols).sharding.is_equivalent_to(by_cols.sharding, 2)
    assert (
        jf.lower(by_cols)
        .compile()
        .input_shardings[0][0]
        .is_equivalent_to(by_cols.sharding, 2)
    )
    assert jf._cache_size() == 2  # pyright: ignore


@rfc("§4")
@pytest.mark.devices(2, reason="P('x') and P() are the same sharding on one device")
def test_jit_in_shardings_committed_mismatch_raises():
    mesh = auto_mesh()
    y = jax.device_put(_uncommitted(), NamedSharding(mesh, P("x")))
    f = jax.jit(lambda a: a * 2, in_shardings=NamedSharding(mesh, P()))
    with pytest.raises(ValueError, match="does not match the sharding on the"):
        f(y)
    # Uncommitted inputs are moved silently.
    assert f(_uncommitted()).sharding.is_equivalent_to(NamedSharding(mesh, P()), 1)


@rfc("§4")
def test_jit_in_shardings_feedback_loop_traces_twice():
    s = NamedSharding(auto_mesh(), P("x"))
    traces = []

    def make():
        def f(a):
            traces.append(None)
            return a * 2

        return jax.jit(f, in_shardings=s, out_shardings=s)

    jf = make()
    x = _uncommitted()
    for _ in range(4):
        x = jf(x)
    assert len(traces) == 2  # once for the uncommitted input, once for the rest
    assert x.committed and x.sharding == s
    # Committing the input first traces once.
    traces.clear()
    jg = make()
    x = jax.device_put(_uncommitted(), s)
    for _ in range(4):
        x = jg(x)
    assert len(traces) == 1


@rfc("§4")
def test_jit_in_shardings_rejects_kwargs_and_devices():
    s = NamedSharding(auto_mesh(), P())
    f = jax.jit(lambda a, b=1.0: a * b, in_shardings=s)
    with pytest.raises(ValueError, match="does not support kwargs"):
        f(_uncommitted(), b=_uncommitted())
    with pytest.raises(TypeError, match="PartitionSpec instances or None"):
        jax.jit(lambda a: a, in_shardings=jax.devices()[1])(_uncommitted())


@rfc("§4")
def test_layout_auto_is_memory_layout_not_sharding():
    """`Layout.AUTO` lets the compiler choose the *memory layout*; the sharding half of
    a `Format` must be a concrete `Sharding` (or `None`), and a committed `jax.Array`
    argument is rejected: AUTO is for `.lower(ShapeDtypeStruct)` then placing inputs
    with `compiled.input_formats`."""
    s = NamedSharding(auto_mesh(), P("x"))
    with pytest.raises(TypeError, match="instance of `jax.Sharding`"):
        Format(Layout.AUTO, P("x"))  # pyright: ignore[reportArgumentType]
    f = jax.jit(lambda a: a * 2, in_shardings=Format(Layout.AUTO, s))
    compiled = f.lower(jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=s)).compile()
    (fmt,), _ = compiled.input_formats
    assert isinstance(fmt.layout, Layout)  # a concrete layout was chosen
    assert fmt.sharding == s  # ... but not a sharding
    y = jax.device_put(jnp.ones((8, 8)), fmt)
    assert compiled(y).sharding.is_equivalent_to(s, 2)
    with pytest.raises(ValueError, match="Layout passed to jit does not match"):
        f(jax.device_put(jnp.ones((8, 8)), s))


@rfc("§4")
def test_lower_without_sharding_compiles_for_one_device():
    """Unspecified `in_shardings` plus a `ShapeDtypeStruct` without a sharding: the
    compiler does not choose a multi-device input sharding."""
    compiled = jax.jit(lambda a: a * 2).lower(jax.ShapeDtypeStruct((8,), jnp.float32))
    (sharding,), _ = compiled.compile().input_shardings
    assert is_single_device_sharding(sharding)


#
# RFC §5: `None`'s three meanings in JAX.
#


@rfc("§5")
def test_none_in_jit_is_unspecified():
    mesh = auto_mesh()
    s = NamedSharding(mesh, P("x"))
    y = jax.device_put(_uncommitted(), s)
    with jax.set_mesh(mesh):
        f = jax.jit(lambda a: a * 2, in_shardings=None, out_shardings=None)
        assert f(y).sharding.is_equivalent_to(s, 1)


@rfc("§5")
def test_none_in_wsc_is_replicated_or_error():
    mesh = auto_mesh()
    y = jax.device_put(_uncommitted(), NamedSharding(mesh, P("x")))
    with pytest.raises(ValueError, match="got sharding None"):
        jax.jit(lambda a: jax.lax.with_sharding_constraint(a, None))(y)
    with jax.set_mesh(mesh):
        out = jax.jit(lambda a: jax.lax.with_sharding_constraint(a * 2, None))(y)
    assert out.sharding.is_fully_replicated


@rfc("§5")
def test_none_in_device_put_leaves_untouched():
    s = NamedSharding(auto_mesh(), P("x"))
    x = _uncommitted()
    a, b = jax.device_put([x, _uncommitted()], [None, s])
    assert a is x and not a.committed
    assert b.sharding == s


#
# RFC §6: donation.
#


@rfc("§6")
@pytest.mark.devices(2, reason="one device's uncommitted array is in place: donated")
def test_donation_deletes_committed_matching_input():
    s = NamedSharding(auto_mesh(), P("x"))
    y = jax.device_put(_uncommitted(), s)
    x = _uncommitted()
    f = jax.jit(lambda a: a * 2, in_shardings=s, out_shardings=s, donate_argnums=0)
    f(y)
    assert y.is_deleted()
    with pytest.raises(RuntimeError, match="deleted"):
        _ = y + 1
    # An uncommitted input is copied onto `s` first; the copy is what is donated.
    f(x)
    assert not x.is_deleted()


_ALIASED_DONATION = textwrap.dedent(
    """
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
    a = jax.device_put(jnp.arange(64.0), NamedSharding(mesh, P("x")))
    out = jax.jit(lambda u, v: u + v, donate_argnums=0)(a, a)
    print(out.block_until_ready())
    """
)


@pytest.mark.slow
@rfc("§6")
def test_donating_aliased_multidevice_buffer_crashes():
    """`jax.jit(f, donate_argnums=0)(a, a)` with `a` sharded over several devices
    kills the process (SIGSEGV on JAX 0.10.2 CPU). Run in a subprocess."""
    try:
        result = subprocess.run(
            [sys.executable, "-c", _ALIASED_DONATION],
            capture_output=True,
            text=True,
            env=child_env(),
            timeout=HANG_SECONDS,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the aliased donation hung instead of crashing")
    assert result.returncode != 0, result.stdout
    assert result.returncode < 0 or "donated" in result.stderr, result.stderr[-2000:]


_DONATE_TO_SINGLE_DEVICE_SHARDING = textwrap.dedent(
    """
    import sys
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp
    from jax.sharding import make_single_device_sharding
    x = jax.device_put(jnp.arange(64.0), jax.devices()[1])
    target = jax.devices()[2]
    if sys.argv[1] == "sharding":
        target = make_single_device_sharding(target)
    y = jax.device_put(x, target, donate=True)
    print(float(jnp.sum(y)), x.is_deleted(), flush=True)
    """
)


@pytest.mark.slow
@pytest.mark.cpu(reason="a fact about the CPU backend")
@rfc("§6")
def test_device_put_donate_to_single_device_sharding_crashes():
    """`jax.device_put(x, SingleDeviceSharding(d), donate=True)` for an `x` on another
    single device frees `x`'s buffer without marking `x` deleted: the next use of `x`
    (even `x.is_deleted()`) kills the process on CPU; JAX 0.12.1 marks `x` deleted. The
    same call with the `jax.Device` `d` leaves `x` intact. Run in a subprocess."""
    results = {}
    for target in ("device", "sharding"):
        results[target] = subprocess.run(
            [sys.executable, "-c", _DONATE_TO_SINGLE_DEVICE_SHARDING, target],
            capture_output=True,
            text=True,
            env=child_env(),
            timeout=HANG_SECONDS,
        )
    assert results["device"].returncode == 0, results["device"].stderr[-2000:]
    assert results["device"].stdout.strip() == "2016.0 False"
    if jax_at_least("0.12.1"):
        assert results["sharding"].returncode == 0, results["sharding"].stderr[-2000:]
        assert results["sharding"].stdout.strip() == "2016.0 True"
    else:
        assert results["sharding"].returncode < 0, results["sharding"].stdout


@pytest.mark.cpu(reason="a fact about the CPU backend")
@rfc("§6")
def test_device_put_donate_is_best_effort_on_cpu():
    mesh = auto_mesh()
    x = jax.device_put(_uncommitted(), NamedSharding(mesh, P()))
    y = jax.device_put(x, NamedSharding(mesh, P("x")), donate=True)
    assert not x.is_deleted()
    assert np.array_equal(x, y)


def test_shard_map_reads_out_specs_after_tracing():
    # `filter_shard_map` learns its output's structure, and so its per-leaf
    # `out_specs`, while `jax.shard_map` traces the function; it relies on
    # `jax.shard_map` reading `out_specs` only after that trace.
    mesh = jax.make_mesh(
        (jax.device_count(),), ("x",), axis_types=(jax.sharding.AxisType.Auto,)
    )
    specs = []

    def f(x):
        specs[:] = [P("x"), P()]
        return [x * 2, jax.lax.psum(x.sum(), "x")]

    out = jax.shard_map(f, mesh=mesh, in_specs=(P("x"),), out_specs=specs)(
        jnp.arange(16.0)
    )
    np.testing.assert_array_equal(out[0], jnp.arange(16.0) * 2)
    assert out[1] == 120.0
    assert out[0].sharding.spec == P("x")


#
# RFC §13: explaining cache misses.
#


@rfc("§13")
@pytest.mark.devices(2, reason="on one device P('x') is P(): nothing recompiles")
def test_monitoring_names_a_jit_trace_and_compile():
    # `explain_misses` hears a recompile without a retrace through these two
    # `jax.monitoring` events: a trace with the function's name, a compile with
    # `jit(<name>)`; a new sharding of an Auto-axes input compiles without a trace.
    events = []
    record = lambda event, duration_secs, **kwargs: events.append((event, kwargs))
    jax.monitoring.register_event_duration_secs_listener(record)
    mesh = auto_mesh(names=("x",))

    def spelled(x):
        return x + 1

    jitted = jax.jit(spelled)
    try:
        jitted(jax.device_put(jnp.ones(8), NamedSharding(mesh, P())))
        first = events[:]
        events.clear()
        jitted(jax.device_put(jnp.ones(8), NamedSharding(mesh, P("x"))))
    finally:
        jax.monitoring.unregister_event_duration_listener(record)
    named = [e for e, kwargs in events if "spelled" in str(kwargs.get("fun_name"))]
    assert "/jax/core/compile/backend_compile_duration" in named
    assert "/jax/core/compile/jaxpr_trace_duration" not in named
    compiles = [k for e, k in events if e.endswith("/backend_compile_duration")]
    assert {"fun_name": "jit(spelled)"} in compiles
    trace = ("/jax/core/compile/jaxpr_trace_duration", {"fun_name": "spelled"})
    assert trace in first
