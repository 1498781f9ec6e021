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

import contextlib
import functools as ft
from typing import Any

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
    NamedSharding,
    PartitionSpec as P,
    Sharding,
    SingleDeviceSharding,
)

from .helpers import assert_alive, assert_same_values, snapshot
from .hypothesis_profiles import examples


pytestmark = pytest.mark.skipif(
    jax.default_backend() != "cpu", reason="simulates 8 CPU devices"
)


#
# Meshes, and the PartitionSpecs that can be tried on each.
#

_MESHES = {
    "1d": ((8,), ("x",)),
    "2d": ((4, 2), ("a", "b")),
}
_PSPECS = {
    "1d": [P(), P(None), P("x"), P(None, "x"), P("x", None), P(None, None, "x")],
    "2d": [
        P(),
        P("a"),
        P("b"),
        P(("a", "b")),
        P("a", "b"),
        P("b", "a"),
        P(None, ("b", "a")),
        P("a", None, "b"),
    ],
}


@ft.cache
def _mesh(kind: str, axis_type: AxisType) -> jax.sharding.Mesh:
    shape, names = _MESHES[kind]
    return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))


def _fits(pspec: P, shape: tuple, mesh) -> bool:
    if len(pspec) > len(shape):
        return False
    for size, entry in zip(shape, pspec):
        names = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
        parts = int(np.prod([mesh.shape[n] for n in names]))
        if size % parts:
            return False
    return True


def _fitting(mesh, kind: str, shapes: list) -> list:
    return [p for p in _PSPECS[kind] if all(_fits(p, s, mesh) for s in shapes)]


#
# Random PyTrees.
#

_DTYPES = (np.float32, np.int32, np.bool_, jnp.bfloat16, np.uint8, np.complex64)
_SIZES = (1, 2, 8, 16)


def _relu(x):
    return jnp.maximum(x, 0)


_STATIC_LEAVES = (
    0,
    2.5,
    True,
    "name",
    _relu,
    jax.nn.gelu,
    jax.ShapeDtypeStruct((2,), jnp.float32),
    object(),
)


class _Pair(eqx.Module):
    first: Any
    second: Any
    tag: str = eqx.field(static=True)


class _Single(eqx.Module):
    value: Any


def _host_array(rng, shape, dtype):
    if dtype == np.bool_:
        return rng.random(shape) > 0.5
    if dtype == np.complex64:
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(
            dtype
        )
    if np.issubdtype(dtype, np.integer):
        return rng.integers(0, 100, shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


@st.composite
def _arrays(draw, *, placements):
    """One array leaf. `placements(shape)` lists the shardings that an already-placed
    (committed) input may carry."""
    shape = tuple(draw(st.lists(st.sampled_from(_SIZES), max_size=3)))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    kind = draw(st.sampled_from(["jax", "numpy", "placed", "key"]))
    if kind == "key":
        data = rng.integers(0, 2**32, shape + (2,), dtype=np.uint32)
        return jax.random.wrap_key_data(jnp.asarray(data))
    dtype = draw(st.sampled_from(_DTYPES))
    host = _host_array(rng, shape, dtype)
    if kind == "numpy":
        return host if shape else host[()]  # a NumPy scalar for rank 0
    if kind == "placed":
        return jax.device_put(host, draw(st.sampled_from(placements(shape))))
    return jnp.asarray(host)


@st.composite
def _trees(draw, leaves, *, depth=3, top=True):
    """A PyTree of up to `depth` levels of dicts, lists, tuples and Modules; the top
    level is always a node with at least two children."""
    if not top and (depth == 0 or draw(st.integers(0, 2)) == 0):
        # Arrays three times as often as anything else.
        static = st.sampled_from(_STATIC_LEAVES)
        return draw(st.one_of(leaves, leaves, leaves, static, st.none()))
    n = draw(st.integers(2 if top else 1, 4))
    children = [draw(_trees(leaves, depth=depth - 1, top=False)) for _ in range(n)]
    kind = draw(st.sampled_from(["dict", "list", "tuple", "Module", "Module"]))
    if kind == "dict":
        return dict(zip("abcd", children))
    if kind == "list":
        return children
    if kind == "tuple":
        return tuple(children)
    if len(children) == 1:
        return _Single(children[0])
    return _Pair(children[0], children[1:], draw(st.sampled_from(["p", "q"])))


#
# Random specifications, and what they should resolve to.
#


def _is_node(x) -> bool:
    return x is not None and not jtu.treedef_is_leaf(jtu.tree_structure(x))


def _is_spec_leaf(x) -> bool:
    return x is None or isinstance(x, (Sharding, P, jax.Device)) or callable(x)


def _replicate_scalars(mesh, leaf):
    """A rule: leave scalars as they are, replicate everything else."""
    return None if leaf.ndim == 0 else NamedSharding(mesh, P())


def _split_largest(mesh, kind, leaf):
    """A rule: split the largest dimension that the whole mesh divides."""
    for p in reversed(_PSPECS[kind]):
        if len(p) == 1 and _fits(p, leaf.shape, mesh):
            return NamedSharding(mesh, p)
    return NamedSharding(mesh, P())


def _bare_first_fitting(kind, leaf):
    """A rule returning a bare PartitionSpec (so: the context mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    return [p for p in _PSPECS[kind] if _fits(p, leaf.shape, mesh)][-1]


def _to_device(device, leaf):
    return device


@st.composite
def _spec_leaves(draw, arrays, mesh, kind, *, bare, single_device):
    shapes = [np.shape(x) for x in arrays]
    pspecs = _fitting(mesh, kind, shapes)
    options = ["none", "named", "named", "rule", "rule"]
    if bare:
        options.append("bare")
    if single_device:
        options.append("device")
    option = draw(st.sampled_from(options))
    if option == "none":
        return None
    if option == "named":
        return NamedSharding(mesh, draw(st.sampled_from(pspecs)))
    if option == "bare":
        return draw(st.sampled_from(pspecs))
    if option == "device":
        device = draw(st.sampled_from(jax.devices()))
        return draw(st.sampled_from([device, SingleDeviceSharding(device)]))
    rules = [
        ft.partial(_replicate_scalars, mesh),
        ft.partial(_split_largest, mesh, kind),
    ]
    if bare:
        rules.append(ft.partial(_bare_first_fitting, kind))
    if single_device:
        rules.append(ft.partial(_to_device, draw(st.sampled_from(jax.devices()))))
    return draw(st.sampled_from(rules))


@st.composite
def _specs(draw, value, mesh, kind, *, bare, single_device):
    """A PyTree prefix of `value`: at each node, either one spec leaf for the whole
    subtree, or a node of the same type with a spec per child."""

    def spec_for(node):
        if _is_node(node) and draw(st.booleans()):
            children, treedef = jtu.tree_flatten(node, is_leaf=lambda y: y is not node)
            return jtu.tree_unflatten(treedef, [spec_for(c) for c in children])
        arrays = [x for x in jtu.tree_leaves(node) if eqx.is_array(x)]
        return draw(
            _spec_leaves(arrays, mesh, kind, bare=bare, single_device=single_device)
        )

    return spec_for(value)


def _expected(value, spec) -> list:
    """The sharding each leaf of `value` should end up with: `None` for a non-array
    leaf or one that is left as it is."""
    spec_leaves = jtu.tree_flatten_with_path(spec, is_leaf=_is_spec_leaf)[0]
    out = []
    for path, leaf in jtu.tree_flatten_with_path(value)[0]:
        (spec_leaf,) = [s for p, s in spec_leaves if path[: len(p)] == p]
        if not eqx.is_array(leaf):
            out.append(None)
            continue
        if callable(spec_leaf) and not isinstance(spec_leaf, (Sharding, jax.Device)):
            spec_leaf = spec_leaf(leaf)
        if isinstance(spec_leaf, jax.Device):
            spec_leaf = SingleDeviceSharding(spec_leaf)
        elif isinstance(spec_leaf, P):
            spec_leaf = NamedSharding(jax.sharding.get_mesh(), spec_leaf)
        out.append(spec_leaf)
    return out


@st.composite
def _examples(draw, *, traced):
    """`(mesh, value, spec, bare)`. With `traced`, everything lives on the mesh's
    devices (one computation cannot mix device sets): no single-device specs or
    inputs."""
    kind = draw(st.sampled_from(list(_MESHES)))
    mesh = _mesh(kind, draw(st.sampled_from([AxisType.Auto, AxisType.Explicit])))

    def placements(shape):
        named = [NamedSharding(mesh, p) for p in _fitting(mesh, kind, [shape])]
        if traced:
            return named
        return named + [SingleDeviceSharding(d) for d in jax.devices()[::3]]

    value = draw(_trees(_arrays(placements=placements)))
    bare = draw(st.booleans())
    spec = draw(_specs(value, mesh, kind, bare=bare, single_device=not traced))
    return mesh, value, spec, bare


def _context(mesh, bare):
    return jax.set_mesh(mesh) if bare else contextlib.nullcontext()


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


def _check_placed(value, out, expected, before):
    """`out` is `value` placed: same structure; non-array leaves and unspecified
    arrays the same objects; specified arrays committed to an equivalent sharding
    (and the same object if they already were); values unchanged."""
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
    with _context(mesh, bare):
        expected = _expected(value, spec)
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
        expected = _expected(value, spec)
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
    with _context(mesh, bare or explicit):
        expected = _expected(value, spec)
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
    sharding = NamedSharding(_mesh("1d", AxisType.Explicit), P("x"))
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
    sharding = NamedSharding(_mesh("1d", AxisType.Auto), P())
    keys = jax.device_put(jax.random.split(jax.random.key(0), 8), sharding)
    tree = {"keys": keys, "w": jax.device_put(jnp.arange(8.0), sharding)}
    out = place(tree, sharding)
    assert out["w"] is tree["w"]
    assert out["keys"] is keys
