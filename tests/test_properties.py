"""Property tests: random PyTrees and random valid specifications.

The PyTrees nest dicts, lists, tuples and `eqx.Module`s, and mix arrays (JAX and NumPy
arrays, NumPy scalars, typed PRNG key arrays; uncommitted or already placed; of random
shapes and dtypes) with non-array leaves. The specifications are random prefixes of
them whose leaves are `None`, `Sharding`s, `jax.Device`s, bare `PartitionSpec`s and
callables, over 1-D `(8,)` and 2-D `(4, 2)` meshes with Auto or Explicit axes, and
valid by construction (every dimension they split is divisible).

The expected sharding of each array leaf is worked out here, independently of the
library: the spec leaf whose key path is a prefix of the array's, resolved by hand.

Run with `-p tests.hypothesis_profiles --hypothesis-profile=long` for many more
examples (see tests/hypothesis_profiles.py).
"""

import equinox as eqx
import equinox_shard as eqxs
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from hypothesis import event, given
from jax.sharding import (
    AxisType,
    make_single_device_sharding,
    NamedSharding,
    PartitionSpec as P,
)

from .helpers import assert_alive, assert_same_values, snapshot
from .hypothesis_profiles import examples
from .strategies import (
    arrays_st,
    cached_mesh,
    expected_shardings,
    fitting_pspecs,
    mesh_context,
    MESHES,
    specs_st,
    trees_st,
)


@st.composite
def _examples(draw, *, traced):
    """`(mesh, value, spec, bare)`. With `traced`, everything lives on the mesh's
    devices (one computation cannot mix device sets): no single-device specs or
    inputs."""
    kind = draw(st.sampled_from(list(MESHES)))
    mesh = cached_mesh(kind, draw(st.sampled_from([AxisType.Auto, AxisType.Explicit])))

    def placements(shape):
        named = [NamedSharding(mesh, p) for p in fitting_pspecs(mesh, kind, [shape])]
        if traced:
            return named
        return named + [make_single_device_sharding(d) for d in jax.devices()[::3]]

    value = draw(trees_st(arrays_st(placements=placements)))
    bare = draw(st.booleans())
    spec = draw(specs_st(value, mesh, kind, bare=bare, single_device=not traced))
    return mesh, value, spec, bare


#
# Checks.
#


def _is_key_array(x) -> bool:
    return eqx.is_array(x) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _describe(value, expected) -> None:
    """Statistics for `--hypothesis-show-statistics`: what the examples exercised."""
    arrays = [x for x in jtu.tree_leaves(value) if eqx.is_array(x)]
    placed = [s for s in expected if s is not None]
    event(f"array leaves: {min(len(arrays), 4)}{'+' if len(arrays) >= 4 else ''}")
    event(f"arrays placed: {min(len(placed), 4)}{'+' if len(placed) >= 4 else ''}")
    event(f"non-array leaves: {len(jtu.tree_leaves(value)) > len(arrays)}")


def _same_type(have, want) -> bool:
    """The docstring's "over the same mesh (on `Explicit` axes, with the same spec)"."""
    mesh, other = (getattr(s, "mesh", None) for s in (have, want))
    if mesh is None or other is None:
        one = mesh if other is None else other
        return one is None or AxisType.Explicit not in one.axis_types
    trim = lambda s: tuple(s.spec)[
        : max([0, *(i + 1 for i, p in enumerate(s.spec) if p is not None)])
    ]
    explicit = AxisType.Explicit in mesh.axis_types
    return mesh == other and (not explicit or trim(have) == trim(want))


def _check_placed(value, out, expected, before):
    """`out` is `value` placed: same structure; non-array leaves and unspecified
    arrays the same objects; specified arrays committed to an equivalent sharding
    (and the same object if they already were, over the same mesh); values unchanged."""
    assert jtu.tree_structure(out) == jtu.tree_structure(value)
    for x, y, sharding in zip(jtu.tree_leaves(value), jtu.tree_leaves(out), expected):
        if sharding is None:
            assert y is x, (x, y)
            continue
        assert isinstance(y, jax.Array), y
        assert y.committed, y
        assert y.sharding.is_equivalent_to(sharding, y.ndim), (y.sharding, sharding)
        if (
            isinstance(x, jax.Array)
            and x.committed
            and x.sharding.is_equivalent_to(sharding, x.ndim)
            and _same_type(x.sharding, sharding)
        ):
            assert y is x, "an already-placed array must be returned as it is"
    assert_same_values(out, before)
    assert_alive(value)
    assert_same_values(value, before)


@pytest.mark.parametrize(
    "place", [eqxs.filter_device_put, eqxs.filter_shard], ids=lambda f: f.__name__
)
@examples(ci=80)
@given(example=_examples(traced=False))
def test_eager_placement(place, example):
    mesh, value, spec, bare = example
    before = snapshot(value)
    with mesh_context(mesh, bare):
        expected = expected_shardings(value, spec)
        out = place(value, spec)
        again = place(out, spec)
    _describe(value, expected)
    _check_placed(value, out, expected, before)
    # Placing what is already placed does nothing: every leaf comes back as it is.
    # (Except typed PRNG key arrays: see test_placed_key_array_is_returned_as_is.)
    for a, b in zip(jtu.tree_leaves(again), jtu.tree_leaves(out)):
        assert a is b or _is_key_array(b), (a, b)


@examples(ci=30)
@given(example=_examples(traced=True))
def test_traced_filter_shard_agrees_with_eager(example):
    mesh, value, spec, bare = example
    before = snapshot(value)
    dynamic, static = eqx.partition(value, eqx.is_array)

    @jax.jit
    def traced(dynamic):
        out = eqxs.filter_shard(eqx.combine(dynamic, static), spec)
        return eqx.filter(out, eqx.is_array)

    # Everything under the mesh: Explicit axes need it to trace uncommitted inputs.
    with jax.set_mesh(mesh):
        expected = expected_shardings(value, spec)
        eager = eqxs.filter_shard(value, spec)
        traced_out = eqx.combine(traced(dynamic), static)
    _describe(value, expected)
    _check_placed(value, eager, expected, before)
    assert_same_values(traced_out, eager)
    for x, a, b, sharding in zip(
        jtu.tree_leaves(value),
        jtu.tree_leaves(traced_out),
        jtu.tree_leaves(eager),
        expected,
    ):
        if sharding is not None:
            assert a.sharding.is_equivalent_to(sharding, a.ndim), (a.sharding, sharding)
            assert a.sharding.is_equivalent_to(b.sharding, a.ndim)


@examples(ci=30)
@given(example=_examples(traced=True))
def test_filter_jit_out_shardings_agrees_with_filter_shard(example):
    mesh, value, spec, bare = example
    before = snapshot(value)
    # Explicit axes need the mesh set: see test_out_shardings_explicit_without_mesh.
    explicit = mesh.axis_types[0] == AxisType.Explicit
    with mesh_context(mesh, bare or explicit):
        expected = expected_shardings(value, spec)
        eager = eqxs.filter_shard(value, spec)
        out = eqxs.filter_jit(lambda tree: tree, out_shardings=spec)(value)
    _describe(value, expected)
    assert_alive(value)
    assert_same_values(value, before)
    assert jtu.tree_structure(out) == jtu.tree_structure(value)
    for x, y, z, sharding in zip(
        jtu.tree_leaves(value), jtu.tree_leaves(out), jtu.tree_leaves(eager), expected
    ):
        if not eqx.is_array(x):
            assert y is x, (x, y)
            continue
        assert y.shape == np.shape(x) and y.dtype == x.dtype, (x, y)
        if sharding is not None:
            assert y.sharding.is_equivalent_to(sharding, y.ndim), (y.sharding, sharding)
            assert y.sharding.is_equivalent_to(z.sharding, y.ndim)
    # Values: NumPy inputs come back as JAX arrays, hence compared through the host.
    assert_same_values(snapshot(out), before)


def test_out_shardings_explicit_without_mesh():
    sharding = NamedSharding(cached_mesh("1d", AxisType.Explicit), P("x"))
    x = jnp.arange(8.0)
    expected = jax.jit(lambda t: 2 * t, out_shardings=sharding)(x)
    out = eqxs.filter_jit(lambda t: 2 * t, out_shardings=sharding)(x)
    assert out.sharding.is_equivalent_to(expected.sharding, 1)
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize(
    "place", [eqxs.filter_device_put, eqxs.filter_shard], ids=lambda f: f.__name__
)
def test_placed_key_array_is_returned_as_is(place):
    # Replicated: a key array's sharding then reads P(None,), equivalent to P() but
    # not equal, so `jax.device_put` makes a new object.
    sharding = NamedSharding(cached_mesh("1d", AxisType.Auto), P())
    keys = jax.device_put(jax.random.split(jax.random.key(0), 8), sharding)
    tree = {"keys": keys, "w": jax.device_put(jnp.arange(8.0), sharding)}
    out = place(tree, sharding)
    assert out["w"] is tree["w"]
    assert out["keys"] is keys
