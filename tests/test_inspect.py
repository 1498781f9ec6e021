import equinox as eqx
import equinox_shard as eqxs
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jax.sharding import make_single_device_sharding, NamedSharding, PartitionSpec as P

from .helpers import auto_mesh, explicit_mesh


def _rows(table: str) -> list[list[str]]:
    """The body of the table (no header, rules or total), split on runs of 2+ spaces."""
    lines = table.splitlines()
    assert set(lines[1]) == {"-"} and set(lines[-2]) == {"-"}
    return [_split(line) for line in lines[2:-2]]


def _split(line: str) -> list[str]:
    return [cell.strip() for cell in line.split("  ") if cell.strip()]


def _total(table: str) -> str:
    *_, total = table.splitlines()
    name, value = _split(total)
    assert name == "total"
    return value


@pytest.mark.parametrize("make_mesh", (auto_mesh, explicit_mesh))
def test_mlp(make_mesh, getkey):
    mesh = make_mesh((4, 2), ("data", "model"))
    model = eqx.nn.MLP(64, 10, 128, 1, key=getkey())

    def spec(leaf):
        if leaf.shape == (128, 64):
            return NamedSharding(mesh, P("model", "data"))
        if leaf.shape == (128,):
            return NamedSharding(mesh, P(("data", "model")))
        return NamedSharding(mesh, P())

    model = eqxs.filter_device_put(model, spec)
    table = eqxs.sharding_table(model, name="model")
    assert table == "\n".join(
        [
            "path                    shape      dtype    sharding               bytes/device",  # noqa: E501
            "-------------------------------------------------------------------------------",  # noqa: E501
            "model.layers[0].weight  (128, 64)  float32  P('model', 'data')          4.0 KiB",  # noqa: E501
            "model.layers[0].bias    (128,)     float32  P(('data', 'model'),)          64 B",  # noqa: E501
            "model.layers[1].weight  (10, 128)  float32  P()                         5.0 KiB",  # noqa: E501
            "model.layers[1].bias    (10,)      float32  P()                            40 B",  # noqa: E501
            "-------------------------------------------------------------------------------",  # noqa: E501
            "total                                                                   9.1 KiB",  # noqa: E501
        ]
    )
    # 128*64*4/8 + 128*4/8 + 10*128*4 + 10*4 = 4096 + 64 + 5120 + 40 = 9320 bytes.


def test_non_arrays_are_skipped(getkey):
    model = eqx.nn.MLP(2, 3, 4, 1, key=getkey())
    tree = {"model": model, "step": 3, "name": "mlp", "fn": jax.nn.relu}
    rows = _rows(eqxs.sharding_table(tree))
    assert [row[0] for row in rows] == [
        "['model'].layers[0].weight",
        "['model'].layers[0].bias",
        "['model'].layers[1].weight",
        "['model'].layers[1].bias",
    ]


def test_single_device_committed_and_uncommitted():
    devices = jax.devices()
    x = jnp.zeros((3, 5), jnp.float32)
    assert not x.committed
    y = jax.device_put(jnp.zeros((7,), jnp.int8), devices[1])
    assert y.committed
    rows = _rows(eqxs.sharding_table([x, y]))
    assert rows == [
        ["[0]", "(3, 5)", "float32", f"{devices[0]} uncommitted", "60 B"],
        ["[1]", "(7,)", "int8", str(devices[1]), "7 B"],
    ]
    assert str(devices[1]) == "cpu:1"


def test_total_is_the_most_loaded_device():
    # Two different devices: the total is the larger of the two, not their sum.
    devices = jax.devices()
    tree = (
        jax.device_put(jnp.zeros(100, jnp.float32), devices[0]),
        jax.device_put(jnp.zeros(25, jnp.float32), devices[1]),
        jax.device_put(jnp.zeros(50, jnp.float32), devices[1]),
    )
    assert _total(eqxs.sharding_table(tree)) == "400 B"
    tree = tree + (jax.device_put(jnp.zeros(30, jnp.float32), devices[1]),)
    assert _total(eqxs.sharding_table(tree)) == "420 B"


def test_replicated_vs_sharded():
    mesh = auto_mesh()
    x = jnp.zeros((8, 256), jnp.float32)
    replicated = jax.device_put(x, NamedSharding(mesh, P()))
    sharded = jax.device_put(x, NamedSharding(mesh, P("x")))
    rows = _rows(eqxs.sharding_table({"r": replicated, "s": sharded}))
    # Per device: all 8 KiB replicated, an n-th of them split over n devices.
    n = mesh.size
    assert rows == [
        ["['r']", "(8, 256)", "float32", "P()", "8.0 KiB"],
        ["['s']", "(8, 256)", "float32", "P('x',)", f"{8 / n:.1f} KiB"],
    ]
    total = _total(eqxs.sharding_table({"r": replicated, "s": sharded}))
    assert total == f"{8 + 8 / n:.1f} KiB"


def test_numpy_is_host():
    table = eqxs.sharding_table({"a": np.zeros((2, 3)), "b": np.float32(1.0)})
    assert _rows(table) == [
        ["['a']", "(2, 3)", "float64", "host", "-"],
        ["['b']", "()", "float32", "host", "-"],
    ]
    assert _total(table) == "-"


def test_shape_dtype_struct():
    mesh = auto_mesh((4,), ("x",))
    table = eqxs.sharding_table(
        [
            jax.ShapeDtypeStruct((1024, 1024), jnp.float32),
            # Uneven: 10 over 4 devices is padded to 3 per device.
            jax.ShapeDtypeStruct(
                (10,), jnp.float32, sharding=NamedSharding(mesh, P("x"))
            ),
            jax.ShapeDtypeStruct(
                (1024, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "x"))
            ),
        ]
    )
    assert _rows(table) == [
        ["[0]", "(1024, 1024)", "float32", "unspecified", "-"],
        ["[1]", "(10,)", "float32", "P('x',)", "12 B"],
        ["[2]", "(1024, 1024)", "bfloat16", "P(None, 'x')", "512.0 KiB"],
    ]
    assert _total(table) == "512.0 KiB"


def test_prng_keys():
    mesh = auto_mesh()
    keys = jax.device_put(jr.split(jr.key(0), 16), NamedSharding(mesh, P("x")))
    ((path, shape, dtype, sharding, size),) = _rows(eqxs.sharding_table(keys))
    assert (path, shape, dtype, sharding) == ("(root)", "(16,)", "key<fry>", "P('x',)")
    # Each threefry key is two uint32s; each device holds 16 / n keys (2 of 8).
    assert size == f"{8 * 16 // mesh.size} B"


def test_memory_kind():
    mesh = auto_mesh()
    sharding = NamedSharding(mesh, P(), memory_kind="pinned_host")
    x = jax.device_put(jnp.zeros(4, jnp.float32), sharding)
    assert _rows(eqxs.sharding_table(x)) == [
        ["(root)", "(4,)", "float32", "P() pinned_host", "16 B"]
    ]


def test_traced():
    tables = []

    @jax.jit
    def f(x):
        tables.append(eqxs.sharding_table({"x": x, "static": 1.0}))
        return x

    f(jnp.zeros(3, jnp.float32))
    (table,) = tables
    assert _rows(table) == [["['x']", "(3,)", "float32", "traced", "-"]]
    assert _total(table) == "-"


def test_empty():
    table = eqxs.sharding_table({"a": None, "b": "string"})
    assert _rows(table) == []
    assert _total(table) == "-"


@pytest.mark.parametrize(
    "nbytes, text",
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (1024**2, "1.0 MiB"),
        (3 * 1024**3, "3.0 GiB"),
    ],
)
def test_byte_units(nbytes, text):
    x = jax.ShapeDtypeStruct(
        (nbytes,), jnp.int8, sharding=make_single_device_sharding(jax.devices()[0])
    )
    assert _rows(eqxs.sharding_table(x))[0][-1] == text
