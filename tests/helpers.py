import contextlib
import logging

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np


def tree_allclose(x, y, *, rtol=1e-5, atol=1e-8):
    return eqx.tree_equal(x, y, typematch=True, rtol=rtol, atol=atol)


def is_single_device_sharding(sharding):
    """`jax.sharding.is_single_device_sharding` (JAX 0.12.1 deprecates naming the class
    `SingleDeviceSharding`), which JAX 0.10.2 lacks."""
    single = jax.sharding.make_single_device_sharding(jax.devices()[0])
    return type(sharding) is type(single)


def grid_shape():
    """The suite's 4x2 grid on the devices there are: (n // 2, 2) on an even number of
    devices, (1, 1) on one (or an odd number)."""
    n = jax.device_count()
    return (n // 2, 2) if n % 2 == 0 else (1, 1)


def nth_device(k):
    """`jax.devices()[k]`, or the last device when there are fewer than `k + 1`."""
    devices = jax.devices()
    return devices[min(k, len(devices) - 1)]


def _shape(shape):
    # One axis over every device there is unless the test asks for a shape.
    return (jax.device_count(),) if shape is None else shape


def auto_mesh(shape=None, names=("x",)):
    """A mesh of Auto axes: `shape`, or one axis over every device there is (8 on the
    suite's simulated CPU devices, 1 on one chip)."""
    shape = _shape(shape)
    return jax.make_mesh(
        shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape)
    )


def chip_mesh(names=("x",)):
    """A 1-D Auto mesh over every device there is: for the tests marked
    `accelerator`, which run on a chip's own devices, however many."""
    return auto_mesh(names=names)


def explicit_mesh(shape=None, names=("x",)):
    """As `auto_mesh`, of Explicit axes."""
    shape = _shape(shape)
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


def mixed_mesh(shape=(4, 2), names=("data", "model")):
    """A mesh whose first axis is Explicit and whose other axes are Auto."""
    axis_types = (jax.sharding.AxisType.Explicit,) + (jax.sharding.AxisType.Auto,) * (
        len(shape) - 1
    )
    return jax.make_mesh(shape, names, axis_types=axis_types)


def _is_none(x):
    return x is None


def _host_value(x):
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    # A copy, never a view: on CPU a NumPy view pins the array's buffer, and XLA then
    # declines to donate it, which would hide a deletion from the test.
    return np.array(x, copy=True)


def snapshot(tree):
    """NumPy copies of every array leaf (key arrays as their key data); other leaves
    as they are. For comparing with `assert_same_values` after a call."""
    return jtu.tree_map(lambda x: _host_value(x) if eqx.is_array(x) else x, tree)


def assert_same_values(out, expected):
    """`out` has the structure of `expected`; every array leaf of `out` has the shape,
    dtype and values of the corresponding leaf of `expected` (an array, or a NumPy
    copy from `snapshot`); every non-array leaf of `out` *is* that of `expected`."""
    out_leaves, out_def = jtu.tree_flatten(out, is_leaf=_is_none)
    expected_leaves, expected_def = jtu.tree_flatten(expected, is_leaf=_is_none)
    assert out_def == expected_def, (out_def, expected_def)
    for a, b in zip(out_leaves, expected_leaves):
        if eqx.is_array(b):
            assert eqx.is_array(a), (a, b)
            if isinstance(b, np.ndarray) and jnp.issubdtype(
                a.dtype, jax.dtypes.prng_key
            ):
                a = jax.random.key_data(a)  # `snapshot` stores a key's data.
            assert a.shape == b.shape, (a.shape, b.shape)
            assert a.dtype == b.dtype, (a.dtype, b.dtype)
            np.testing.assert_array_equal(_host_value(a), _host_value(b))
        else:
            assert a is b, (a, b)


def assert_alive(tree):
    """No JAX array leaf of `tree` has been deleted (e.g. by donation)."""
    for leaf in jtu.tree_leaves(tree):
        if isinstance(leaf, jax.Array):
            assert not leaf.is_deleted(), leaf


@contextlib.contextmanager
def count_compiles():
    """Collects one entry per XLA backend compilation in the body (of anything: a
    `jax.jit`, an eager primitive, or a helper compiled by `jax.device_put`)."""
    events = []

    def listener(event: str, duration_secs: float, **kwargs):
        del duration_secs, kwargs
        if event == "/jax/core/compile/backend_compile_duration":
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def assert_array_shardings(tree, expected):
    """Like `assert_shardings`, but `expected` is a list with one entry per *array*
    leaf of `tree` (in order); `None` means 'the leaf is not checked'."""
    leaves = [x for x in jtu.tree_leaves(tree) if eqx.is_array(x)]
    assert len(expected) == len(leaves), (len(expected), len(leaves))
    assert_shardings(leaves, expected)


def make_module(constructor, *args, **kwargs):
    """`constructor(*args, key=..., **kwargs)`, e.g. an `eqx.nn.MLP`, with its arrays
    drawn from NumPy's generator instead of JAX's: the same Module (structure, static
    fields, functions), without compiling JAX's PRNG for every parameter shape."""
    shapes = eqx.filter_eval_shape(constructor, *args, key=jax.random.key(0), **kwargs)
    rng = np.random.default_rng(0)

    def fill(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return jnp.asarray(rng.standard_normal(x.shape).astype(x.dtype))
        return x

    return jtu.tree_map(fill, shapes)


class _CompileLog(logging.Handler):
    def __init__(self):
        super().__init__()
        self.names = []

    def emit(self, record):
        message = record.getMessage()
        if message.startswith("Compiling "):
            self.names.append(message.split(" with ")[0].removeprefix("Compiling "))


@contextlib.contextmanager
def compiled_names():
    """Records the name of every function JAX compiles inside the block."""
    handler = _CompileLog()
    logger = logging.getLogger("jax")
    logger.addHandler(handler)
    previous = jax.config.jax_log_compiles  # pyright: ignore
    jax.config.update("jax_log_compiles", True)
    try:
        yield handler.names
    finally:
        jax.config.update("jax_log_compiles", previous)
        logger.removeHandler(handler)
