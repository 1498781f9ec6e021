"""Hypothesis strategies shared by the property tests (test_properties.py,
test_nothing_lost.py): random PyTrees that mix arrays and non-arrays, meshes, and random
valid specifications of them, with the sharding each array leaf is expected to get,
worked out independently of the library."""

import contextlib
import functools as ft
from typing import Any

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.sharding import (
    AxisType,
    make_single_device_sharding,
    NamedSharding,
    PartitionSpec as P,
    Sharding,
)

from .helpers import grid_shape


#
# Meshes, and the PartitionSpecs that can be tried on each.
#

# The axis names of each kind of mesh, built over the devices there are: "1d" one axis
# over all of them, "2d" the grid of `helpers.grid_shape()` (4x2 on 8 devices).
MESHES = {"1d": ("x",), "2d": ("a", "b")}
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
def cached_mesh(kind: str, axis_type: AxisType) -> jax.sharding.Mesh:
    names = MESHES[kind]
    shape = (jax.device_count(),) if kind == "1d" else grid_shape()
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


def fitting_pspecs(mesh, kind: str, shapes: list) -> list:
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
def arrays_st(draw, *, placements):
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
def trees_st(draw, leaves, *, depth=3, top=True):
    """A PyTree of up to `depth` levels of dicts, lists, tuples and Modules; the top
    level is always a node with at least two children."""
    if not top and (depth == 0 or draw(st.integers(0, 2)) == 0):
        # Arrays three times as often as anything else.
        static = st.sampled_from(_STATIC_LEAVES)
        return draw(st.one_of(leaves, leaves, leaves, static, st.none()))
    n = draw(st.integers(2 if top else 1, 4))
    children = [draw(trees_st(leaves, depth=depth - 1, top=False)) for _ in range(n)]
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


def is_node(x) -> bool:
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
def spec_leaves_st(draw, arrays, mesh, kind, *, bare, single_device):
    shapes = [np.shape(x) for x in arrays]
    pspecs = fitting_pspecs(mesh, kind, shapes)
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
        return draw(st.sampled_from([device, make_single_device_sharding(device)]))
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
def specs_st(draw, value, mesh, kind, *, bare, single_device):
    """A PyTree prefix of `value`: at each node, either one spec leaf for the whole
    subtree, or a node of the same type with a spec per child."""

    def spec_for(node):
        if is_node(node) and draw(st.booleans()):
            children, treedef = jtu.tree_flatten(node, is_leaf=lambda y: y is not node)
            return jtu.tree_unflatten(treedef, [spec_for(c) for c in children])
        arrays = [x for x in jtu.tree_leaves(node) if eqx.is_array(x)]
        return draw(
            spec_leaves_st(arrays, mesh, kind, bare=bare, single_device=single_device)
        )

    return spec_for(value)


def expected_shardings(value, spec) -> list:
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
            spec_leaf = make_single_device_sharding(spec_leaf)
        elif isinstance(spec_leaf, P):
            spec_leaf = NamedSharding(jax.sharding.get_mesh(), spec_leaf)
        out.append(spec_leaf)
    return out


def mesh_context(mesh, bare):
    return jax.set_mesh(mesh) if bare else contextlib.nullcontext()
