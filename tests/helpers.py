import equinox as eqx
import jax
import jax.tree_util as jtu


def tree_allclose(x, y, *, rtol=1e-5, atol=1e-8):
    return eqx.tree_equal(x, y, typematch=True, rtol=rtol, atol=atol)


def auto_mesh(shape=(8,), names=("x",)):
    return jax.make_mesh(
        shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape)
    )


def explicit_mesh(shape=(8,), names=("x",)):
    return jax.make_mesh(
        shape, names, axis_types=(jax.sharding.AxisType.Explicit,) * len(shape)
    )


def assert_shardings(tree, expected):
    """Every array leaf of `tree` carries a sharding equivalent to the corresponding
    leaf of `expected` (a prefix of `tree`; None means 'not checked')."""
    leaves = jtu.tree_leaves(tree)
    specs = jtu.tree_leaves(expected, is_leaf=lambda x: x is None)
    if len(specs) == 1:
        specs = specs * len(leaves)
    assert len(specs) == len(leaves), (len(specs), len(leaves))
    for leaf, sharding in zip(leaves, specs):
        if sharding is None or not eqx.is_array(leaf):
            continue
        assert leaf.committed, leaf
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim), (
            leaf.sharding,
            sharding,
        )
