"""Nothing the caller did not donate is lost: an array passed to any function of this
package without being donated is never deleted or changed, neither by that call nor by
a later call that donates an array the package returned.

References are independent copies (`snapshot`), never NumPy views of the live arrays:
on CPU a view pins the buffer and XLA then declines to donate it, hiding a deletion.
"""

import linecache
import sys
import threading
import time

import equinox as eqx
import equinox_shard as eqxs
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import pytest
from equinox_shard._dispatch import dispatch_lock
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from .helpers import (
    assert_alive,
    assert_same_values,
    assert_shardings,
    grid_shape,
    make_module,
    nth_device,
    snapshot,
)
from .isolated import run_isolated


def _mesh(axis_type):
    return jax.make_mesh(grid_shape(), ("data", "model"), axis_types=(axis_type,) * 2)


# On one device a committed source is already placed on its target (not moved): the
# result is the source itself, as documented, and donating it deletes the source.
_MOVES = pytest.mark.devices(2, reason="on one device the source is already there")


def _double(tree):
    return jtu.tree_map(lambda x: 2 * x if eqx.is_inexact_array(x) else x, tree)


def _layouts(mesh):
    # Replicated (where JAX reuses a single-device buffer), split over one axis and
    # partially replicated, split over both.
    replicated = NamedSharding(mesh, P())
    rows = lambda x: NamedSharding(
        mesh, P("data") if x.shape[0] % mesh.shape["data"] == 0 else P()
    )
    both = lambda x: NamedSharding(
        mesh, P(("data", "model")) if x.shape[0] % mesh.size == 0 else P()
    )
    return {"replicated": replicated, "rows": rows, "both": both}


def _model(getkey):
    del getkey
    return make_module(eqx.nn.MLP, 8, 8, 16, 2)


def _placements():
    return {
        "filter_device_put": eqxs.filter_device_put,
        "may_alias=False": lambda x, s: eqxs.filter_device_put(x, s, may_alias=False),
        "filter_shard": eqxs.filter_shard,
    }


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
@pytest.mark.parametrize("layout", ["replicated", "rows", "both"])
@pytest.mark.parametrize("place", list(_placements()))
def test_donating_a_placed_copy_keeps_the_original(place, layout, axis_type, getkey):
    model = _model(getkey)
    expected = snapshot(model)
    rule = _layouts(_mesh(axis_type))[layout]
    placed = _placements()[place](model, rule)
    spec = rule
    if callable(spec):
        spec = jtu.tree_map(lambda x: spec(x) if eqx.is_array(x) else None, placed)
    assert_shardings(placed, spec)
    step = eqxs.filter_jit(_double, donate="all")
    doubled = step(placed)
    assert_alive(model)
    assert_same_values(model, expected)
    assert_same_values(doubled, _double(expected))
    # The original can be placed (and donated) again.
    again = eqxs.filter_device_put(model, rule)
    step(again)
    assert_alive(model)
    assert_same_values(model, expected)


@_MOVES
def test_placed_key_array_and_committed_input_keep_the_original():
    mesh = _mesh(AxisType.Auto)
    replicated = NamedSharding(mesh, P())
    keys = jax.random.split(jax.random.key(0), 8)
    single = jax.device_put(jnp.arange(8.0), jax.devices()[0])  # committed
    other_mesh = jax.make_mesh(
        (jax.device_count(),), ("x",), axis_types=(AxisType.Auto,)
    )
    elsewhere = jax.device_put(jnp.arange(8.0), NamedSharding(other_mesh, P()))
    tree = {"keys": keys, "single": single, "elsewhere": elsewhere}
    expected = snapshot(tree)
    placed = eqxs.filter_device_put(tree, replicated)
    eqxs.filter_jit(lambda t: jtu.tree_map(lambda x: x, t), donate="all")(placed)
    assert_alive(tree)
    assert_same_values(tree, expected)


def test_uncommitted_inputs_placed_by_filter_jit_are_kept(getkey):
    mesh = _mesh(AxisType.Auto)
    replicated = NamedSharding(mesh, P())
    batch = NamedSharding(mesh, P("data"))
    model = _model(getkey)
    x = jnp.ones((8, 8))
    expected = snapshot((model, x))

    @eqxs.filter_jit(in_shardings=(replicated, batch), donate="none")
    def forward(model, x):
        return model, jax.vmap(model)(x)

    same_model, y = forward(model, x)
    # Donate everything the call returned: the caller's arrays stay alive.
    eqxs.filter_jit(_double, donate="all")((same_model, y))
    assert_alive((model, x))
    assert_same_values((model, x), expected)


def test_make_array_from_process_local_data_keeps_the_original():
    mesh = _mesh(AxisType.Auto)
    local = {"w": jnp.arange(16.0).reshape(8, 2), "b": jnp.arange(2.0)}
    expected = snapshot(local)
    spec = {"w": NamedSharding(mesh, P("data")), "b": NamedSharding(mesh, P())}
    out = eqxs.filter_make_array_from_process_local_data(spec, local)
    eqxs.filter_jit(_double, donate="all")(out)
    assert_alive(local)
    assert_same_values(local, expected)


#
# Ahead-of-time: `Compiled.__call__` runs the checks of a `filter_jit` call.
#


# Each snippet is whole (its imports included), so that it runs on its own in a
# fresh process.
def test_compiled_donated_input_reused():
    # Segfaulted on JAX 0.10.2 (raised without a key path on 0.12).
    run = run_isolated(
        """
import equinox_shard as eqxs
import jax.numpy as jnp
import jax.tree_util as jtu
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))
s = NamedSharding(mesh, P("d"))
double = lambda t: jtu.tree_map(lambda x: 2 * x, t)
f = eqxs.filter_jit(double, donate="all")
a = {"w": jax.device_put(jnp.ones((8, 4)), s)}
c = f.lower(a).compile()
c(a)
try:
    c(a)
except RuntimeError as e:
    report({"type": "RuntimeError", "message": str(e)})
else:
    report({"type": None})
""",
        timeout=120,
    )
    assert run.returncode == 0, run
    assert run.result["type"] == "RuntimeError", run
    assert run.result["message"].startswith("t['w']: this array has been deleted"), run


def test_compiled_one_buffer_in_two_donated_arguments():
    run = run_isolated(
        """
import equinox_shard as eqxs
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))
s = NamedSharding(mesh, P("d"))
f = eqxs.filter_jit(lambda a, b: a + 2 * b, donate="all")
a = jax.device_put(jnp.arange(32.0).reshape(8, 4), s)
struct = jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
c = f.lower(struct, struct).compile()
try:
    c(a, a)
except ValueError as e:
    message = str(e)
else:
    message = None
report({
    "message": message,
    "a": np.array(a).tolist() == np.arange(32.0).reshape(8, 4).tolist(),
})
""",
        timeout=120,
    )
    assert run.returncode == 0, run
    assert run.result is not None, run
    assert run.result["message"].startswith("a and b are the same array"), run
    assert run.result["a"], run


def test_compiled_checks_match_filter_jit(getkey):
    mesh = _mesh(AxisType.Auto)
    s = NamedSharding(mesh, P("data"))
    model = eqxs.filter_device_put(_model(getkey), NamedSharding(mesh, P()))
    x = jax.device_put(jnp.ones((8, 8)), s)
    f = eqxs.filter_jit(lambda model, x: jax.vmap(model)(x), donate="all-except-first")
    compiled = f.lower(model, x).compile()
    x.delete()
    for call in (f, compiled):
        with pytest.raises(RuntimeError, match=r"^x: this array has been deleted"):
            call(model, x)
    assert_alive(model)
    # One buffer as both donated arguments: refused by both, before anything runs.
    g = eqxs.filter_jit(lambda a, b: a + b, donate="all")
    a = jax.device_put(jnp.ones((8, 8)), s)
    expected = snapshot(a)
    struct = jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
    for call in (g, g.lower(struct, struct).compile()):
        with pytest.raises(ValueError, match=r"^a and b are the same array"):
            call(a, a)
        assert_alive(a)
        assert_same_values(a, expected)


#
# Deleted inputs are always named, also when no transfer is needed.
#


@pytest.mark.parametrize("place", [eqxs.filter_device_put, eqxs.filter_shard])
def test_deleted_input_already_placed_on_a_module(place, getkey):
    replicated = NamedSharding(_mesh(AxisType.Auto), P())
    model = eqxs.filter_device_put(_model(getkey), replicated)
    model.layers[1].bias.delete()
    with pytest.raises(
        RuntimeError, match=r"^x\.layers\[1\]\.bias: this array has been deleted"
    ):
        place(model, replicated)
    assert_alive(model.layers[0])


def test_sharding_table_shows_deleted(getkey):
    replicated = NamedSharding(_mesh(AxisType.Auto), P())
    model = eqxs.filter_device_put(_model(getkey), replicated)
    model.layers[0].weight.delete()
    rows = [line.split() for line in eqxs.sharding_table(model).splitlines()[2:-2]]
    assert rows[0] == [
        ".layers[0].weight",
        "(16,",
        "8)",
        "float32",
        "P()",
        "deleted",
        "-",
    ]
    assert rows[1] == [".layers[0].bias", "(16,)", "float32", "P()", "64", "B"]
    total = eqxs.sharding_table(model).splitlines()[-1].split()
    # 4 bytes x (16 + 16 * 16 + 16 + 8 * 16 + 8): every array but the deleted weight.
    assert total == ["total", "1.7", "KiB"]


#
# `filter_shard` inside a trace moves between memory kinds in both directions.
#


@pytest.mark.cpu(reason="memory kinds other than device behave otherwise on a chip")
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_filter_shard_in_trace_moves_between_memory_kinds(axis_type):
    mesh = jax.make_mesh((jax.device_count(),), ("x",), axis_types=(axis_type,))
    device = NamedSharding(mesh, P("x"))
    host = NamedSharding(mesh, P("x"), memory_kind="pinned_host")
    on_host = jax.device_put(jnp.arange(8.0), host)
    on_device = jax.device_put(jnp.ones(8), device)

    @jax.jit
    def to_device(h, d):
        return eqxs.filter_shard(h, device) + d  # fails if `h` stayed in host memory

    @jax.jit
    def to_host(d):
        return eqxs.filter_shard(d, host)

    out = to_device(on_host, on_device)
    assert out.sharding.memory_kind == "device"
    assert out.sharding.is_equivalent_to(device, 1)
    assert_same_values(out, jnp.arange(8.0) + 1)
    back = to_host(on_device)
    assert back.sharding.memory_kind == "pinned_host"
    assert_same_values(back, jnp.ones(8))


def _parts_alive(x):
    """Every device's part of `x` is alive (`x.is_deleted()` alone can miss one)."""
    assert not x.is_deleted()
    for shard in x.addressable_shards:
        assert not shard.data.is_deleted(), shard.device


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
@pytest.mark.parametrize(
    "source, target",
    [
        # the shard on device 7 *is* the target
        pytest.param("replicated", "device 7", marks=_MOVES),
        pytest.param("replicated", "device 0", marks=_MOVES),
        ("replicated", "other mesh"),  # same devices, every shard the same
        pytest.param("device 3", "replicated", marks=_MOVES),  # on one device
    ],
)
def test_placed_copy_shares_no_buffer_with_a_placed_source(source, target, axis_type):
    mesh = jax.make_mesh((jax.device_count(),), ("x",), axis_types=(axis_type,))
    other = jax.make_mesh(grid_shape(), ("a", "b"), axis_types=(axis_type,) * 2)
    shardings = {
        "replicated": NamedSharding(mesh, P()),
        "other mesh": NamedSharding(other, P()),
        "device 0": jax.devices()[0],
        "device 3": nth_device(3),
        "device 7": nth_device(7),
    }
    for shape in [(), (8, 4)]:
        x = jax.device_put(jnp.ones(shape), shardings[source])
        expected = snapshot(x)
        first = eqxs.filter_device_put(x, shardings[target])
        second = eqxs.filter_device_put(x, shardings[target])
        eqxs.filter_jit(_double, donate="all")(first)
        _parts_alive(x)
        _parts_alive(second)
        assert_same_values(x, expected)
        assert_same_values(second, expected)


def test_donating_a_key_array_to_another_device_does_not_crash():
    # `jax.device_put(key, device, donate=True)` frees a typed key array without
    # marking it deleted; the next `is_deleted()` segfaulted.
    run = run_isolated(
        """
import equinox_shard as eqxs
from jax.sharding import make_single_device_sharding
results = []
for target in (jax.devices()[2], make_single_device_sharding(jax.devices()[2])):
    keys = jax.device_put(jax.random.split(jax.random.key(0), 8), jax.devices()[1])
    expected = jax.random.key_data(keys).tolist()
    moved = eqxs.filter_device_put({"k": keys}, target, donate=True)
    results.append([
        keys.is_deleted() or jax.random.key_data(keys).tolist() == expected,
        jax.random.key_data(moved["k"]).tolist() == expected,
    ])
report(results)
""",
        timeout=120,
    )
    assert run.returncode == 0, run
    assert run.result == [[True, True], [True, True]], run


def _donation_targets(where):
    first = jax.devices()[0]
    mesh = jax.make_mesh((jax.device_count(),), ("x",), axis_types=(AxisType.Auto,))
    return {
        "device": first,
        "single-device sharding": jax.sharding.make_single_device_sharding(first),
        "1-device mesh": NamedSharding(jax.sharding.Mesh([first], ("a",)), P()),
        "other device": jax.sharding.make_single_device_sharding(nth_device(1)),
        "replicated": NamedSharding(mesh, P()),
        "rows": NamedSharding(mesh, P("x")),
    }[where]


@pytest.mark.parametrize(
    "where",
    [
        "device",
        "single-device sharding",
        "1-device mesh",
        "other device",
        "replicated",
        "rows",
    ],
)
@pytest.mark.parametrize("committed", [False, True])
def test_donated_input_that_moves_is_freed_as_jax_jit_frees_it(where, committed):
    # The oracle: `jax.jit` with the same shardings and `donate_argnums`, on an equal
    # array. A donated input may be deleted, and is, wherever `jax.jit` deletes it (so
    # donation halves peak memory); the input that is not donated stays alive.
    sharding = _donation_targets(where)
    jax_sharding = (
        sharding
        if isinstance(sharding, jax.sharding.Sharding)
        else jax.sharding.make_single_device_sharding(sharding)
    )

    def make():
        x = jnp.arange(64.0).reshape(8, 8)
        return jax.device_put(x, jax.devices()[0]) if committed else x

    kept = jnp.ones((8, 8))
    kept_expected = snapshot(kept)
    x, reference = make(), make()
    expected = snapshot(x)
    oracle = jax.jit(
        lambda a, b: a * 2 + b,
        in_shardings=jax_sharding,
        out_shardings=jax_sharding,
        donate_argnums=0,
    )
    try:
        oracle(reference, jnp.ones((8, 8)))
    except ValueError:  # `jax.jit` refuses a committed input on another sharding
        oracle_deleted = False
    else:
        oracle_deleted = reference.is_deleted()
    g = eqxs.filter_jit(
        lambda b, a: a * 2 + b,
        in_shardings=(None, sharding),
        out_shardings=sharding,
        donate="all-except-first",
    )
    out = g(kept, x)
    assert x.is_deleted() == oracle_deleted, (x.is_deleted(), oracle_deleted)
    assert_alive(kept)
    assert_same_values(kept, kept_expected)
    assert_same_values(out, expected * 2 + 1)
    assert_shardings(out, jax_sharding)


_DEVICE_SETS = (
    "first four",
    "first four reversed",
    "all",
    "all reversed",
    "middle four",
)


def _on(name: str, spec: P) -> NamedSharding:
    devices = jax.devices()
    # Four of eight devices: half of those there are (one of one).
    half, quarter = max(1, len(devices) // 2), len(devices) // 4
    if name == "device 3":
        chosen = [nth_device(3)]
    else:
        chosen = {
            "first four": devices[:half],
            "first four reversed": devices[:half][::-1],
            "all": devices,
            "all reversed": devices[::-1],
            "middle four": devices[quarter : quarter + half],
        }[name]
    mesh = jax.make_mesh(
        (len(chosen),), ("x",), axis_types=(AxisType.Auto,), devices=chosen
    )
    return NamedSharding(mesh, spec)


@pytest.mark.parametrize("target_spec", [P(), P("x")])
@pytest.mark.parametrize("target", _DEVICE_SETS + ("device 3",))
@pytest.mark.parametrize("source", _DEVICE_SETS + ("device 3",))
def test_donated_input_moved_is_freed_exactly_where_jax_jit_frees_it(
    source, target, target_spec
):
    # The oracle is `jax.jit` with the same `in_shardings` and `donate_argnums`: a
    # replicated input moved onto more, fewer, overlapping or reordered devices.
    if source == target and target_spec == P():
        pytest.skip("not moved")
    make = lambda: jax.device_put(jnp.arange(8.0), _on(source, P()))
    x, reference = make(), make()
    expected = snapshot(x)
    double = lambda a: a * 2
    target_sharding = _on(target, target_spec)
    try:
        jax.jit(double, in_shardings=target_sharding, donate_argnums=0)(reference)
    except ValueError:
        pytest.skip("`jax.jit` refuses this move")
    f = eqxs.filter_jit(
        double,
        in_shardings=target_sharding,
        out_shardings=target_sharding,
        donate="all",
    )
    out = f(x)
    assert x.is_deleted() == reference.is_deleted(), (
        x.is_deleted(),
        reference.is_deleted(),
    )
    if not x.is_deleted():
        assert_same_values(x, expected)
    assert_same_values(out, expected * 2)
    assert_shardings(out, target_sharding)


def test_donating_one_value_twice_inside_an_outer_trace():
    f = eqxs.filter_jit(lambda a, b: a + b, donate="all")
    x = jnp.arange(8.0)
    expected = snapshot(x)
    out = jax.jit(lambda x: f(x, x))(x)
    assert_same_values(out, expected * 2)
    grad = jax.grad(lambda x: f(x, x).sum())(x)
    assert_same_values(grad, jnp.full(8, 2.0))
    assert_alive(x)


class _Named(eqx.Module):
    w: jax.Array

    def __call__(self, a, b, *xs, c, outputs):
        total = self.w + a + b + sum(xs) + c
        return tuple(total + k for k in range(outputs))


class _Variadic(eqx.Module):
    w: jax.Array

    def __call__(self, *xs, c, outputs):
        total = self.w + sum(xs) + c
        return tuple(total + k for k in range(outputs))


@pytest.mark.parametrize("outputs", [1, 2, 3])
@pytest.mark.parametrize("donate", ["all", "all-except-first"])
@pytest.mark.parametrize("call", ["named", "named and variadic", "variadic"])
def test_donated_buffers_reused_as_under_equinox(call, donate, outputs):
    # Each output reuses the first donated input of its shape, in the order given to
    # `jax.jit`: the same inputs are deleted as under `eqx.filter_jit`, so a loop that
    # reuses the Module (or an argument) works under both or under neither.
    def deleted(jit):
        fun = {"variadic": _Variadic}.get(call, _Named)(jnp.ones(4))
        n_args = {"named": 2}.get(call, 4)
        args = [jnp.full(4, float(k)) for k in range(n_args)]
        c = jnp.full(4, 9.0)
        jax.block_until_ready(jit(fun, donate=donate)(*args, c=c, outputs=outputs))
        return [x.is_deleted() for x in (fun.w, *args, c)]

    assert deleted(eqxs.filter_jit) == deleted(eqx.filter_jit)


def test_bound_method_arrays_are_constants_never_donated():
    # docs/semantics.md: a bound method is static, as in `eqx.filter_jit`.
    model = eqx.nn.Linear(3, 2, key=jax.random.key(0))
    x = jnp.ones(3)
    ours = eqxs.filter_jit(model.__call__, donate="all")
    reference = eqx.filter_jit(model.__call__, donate="all")
    assert_same_values(ours(x + 0), reference(x + 0))
    assert model.bias is not None
    assert not model.weight.is_deleted() and not model.bias.is_deleted()
    (main,) = [l for l in ours.lower(x).as_text().splitlines() if "@main(" in l]
    assert "%arg0: tensor<3xf32>" in main and "%arg1" not in main  # x alone


# Each target that places an array on one device, as `filter_device_put(...,
# donate=True)` is given it, from a source on one other device (or the same one, in
# another memory): `jax.device_put` onto any of them but a `jax.Device` segfaulted on
# JAX 0.10.2 at the next use of the donated source, or refused ("Donation across
# different memory kinds is not implemented").
_DONATE_ONTO_ONE_DEVICE = """
import numpy as np
import equinox_shard as eqxs
import jax.numpy as jnp
from jax.experimental.layout import Format, Layout
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

one, other = jax.devices()[1], jax.devices()[2]
single = jax.sharding.make_single_device_sharding
mesh = Mesh(np.array([other]), ("d",))
explicit = Mesh(np.array([other]), ("d",), axis_types=(AxisType.Explicit,))
square = Mesh(np.array([[other]]), ("a", "b"))
rows = NamedSharding(jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,)), P("x"))
targets = {
    "1-device mesh": NamedSharding(mesh, P()),
    "1-device mesh, split": NamedSharding(mesh, P("d")),
    "1x1 mesh": NamedSharding(square, P("a", "b")),
    "1-device Explicit mesh": NamedSharding(explicit, P("d")),
    "1-device mesh, device memory": NamedSharding(mesh, P(), memory_kind="device"),
    "Format without a layout": Format(None, NamedSharding(mesh, P())),
    "Format with a layout": Format(Layout((0, 1)), NamedSharding(mesh, P())),
    "pinned_host": NamedSharding(mesh, P(), memory_kind="pinned_host"),
    "unpinned_host": single(other, memory_kind="unpinned_host"),
    # Into another memory, on the same device and on several.
    "pinned_host, same device": single(one, memory_kind="pinned_host"),
    "rows in pinned_host": rows.with_memory_kind("pinned_host"),
}
value = lambda: jnp.arange(64.0).reshape(8, 8)
sources = {
    "committed": lambda kind: jax.device_put(value(), single(one, memory_kind=kind)),
    "uncommitted": lambda kind: value(),
    "rows": lambda kind: jax.device_put(value(), rows),
}
cases = [(t, s, None) for t in list(targets)[:9] for s in ("committed", "uncommitted")]
cases += [(t, "committed", t) for t in ("pinned_host", "unpinned_host")]
cases += [("pinned_host, same device", "committed", None)]
cases += [("rows in pinned_host", "rows", None)]
results = {}
for target, source, kind in cases:
    x = sources[source](kind)
    expected = np.array(x, copy=True)
    y = eqxs.filter_device_put({"w": x}, targets[target], donate=True)
    name = f"{target} from {source}" + (f" in {kind}" if kind else "")
    # The source is kept, not freed unmarked (JAX 0.10.2's crash) nor refused.
    results[name] = [
        not x.is_deleted() and np.array_equal(np.asarray(x), expected),
        np.array_equal(np.asarray(y["w"]), expected),
        y["w"].sharding == getattr(targets[target], "sharding", targets[target]),
    ]
    print(name, flush=True)  # the last line before a crash names its case
report(results)
"""


def test_donating_onto_one_device_of_any_shape_keeps_the_source():
    run = run_isolated(_DONATE_ONTO_ONE_DEVICE, timeout=300)
    assert run.returncode == 0, run
    assert len(run.result) == 22, run
    assert all(r == [True, True, True] for r in run.result.values()), run.result


# A donated array in `unpinned_host` memory aborted the process on one device (XLA:
# "PjRtBuffer's memory kind does not match sharding's memory kind"; plain `jax.jit`
# too): refused before anything runs, naming it, whether it is passed there or placed
# there by `in_shardings`; in device or `pinned_host` memory, or moved out, it runs.
_DONATE_UNPINNED = """
import equinox as eqx
import equinox_shard as eqxs
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

auto = (AxisType.Auto,)
one = jax.make_mesh((1,), ("x",), axis_types=auto, devices=jax.devices()[:1])
eight = jax.make_mesh((8,), ("x",), axis_types=auto)
host = NamedSharding(one, P(), memory_kind="unpinned_host")
double = lambda a: {"y": a["w"] * 2}
results = {}


def call(name, f, x):
    expected = np.array(x, copy=True)
    try:
        out = f({"w": x})["y"]
        results[name] = ["ran", np.array_equal(np.asarray(out), expected * 2)]
    except ValueError as e:
        alive = not x.is_deleted() and np.array_equal(np.asarray(x), expected)
        results[name] = [str(e).split(":")[0], "unpinned_host" in str(e), alive]
    print(name, flush=True)  # the last line before a crash names its case


x = lambda s: jax.device_put(jnp.arange(16.0), s)
call("passed, one device", eqxs.filter_jit(double, donate="all"), x(host))
split = NamedSharding(eight, P("x"), memory_kind="unpinned_host")
call("passed, eight devices", eqxs.filter_jit(double, donate="all"), x(split))
onto = eqxs.filter_jit(double, in_shardings=host, donate="all")
call("placed there", onto, x(NamedSharding(one, P())))
out = eqxs.filter_jit(double, in_shardings=NamedSharding(one, P()), donate="all")
call("moved out", out, x(host))
call("not donated", eqxs.filter_jit(double), x(host))
pinned = NamedSharding(one, P(), memory_kind="pinned_host")
call("pinned_host", eqxs.filter_jit(double, donate="all"), x(pinned))


class Scale(eqx.Module):
    w: jax.Array

    def __call__(self, a):
        return {"y": a["w"] * 2 + 0 * self.w.sum()}


module = eqxs.filter_jit(Scale(x(host)), donate="all")
call("the function's own", module, x(NamedSharding(one, P())))
report(results)
"""


def test_donating_an_array_in_unpinned_host_memory_is_refused():
    run = run_isolated(_DONATE_UNPINNED, timeout=300)
    assert run.returncode == 0, run
    assert run.result == {
        "passed, one device": ["a['w']", True, True],
        "passed, eight devices": ["a['w']", True, True],
        "placed there": ["a['w']", True, True],
        "moved out": ["ran", True],
        "not donated": ["ran", True],
        "pinned_host": ["ran", True],
        "the function's own": ["fun.w", True, True],
    }, run


# `filter_device_put(..., donate=True)` from each source form onto each target the
# trial used: where the source is not donated (JAX keeps it, or we keep it, as onto one
# device) the result is a copy, never sharing a buffer with it, so that donating the
# source afterwards leaves the result alive.
_DONATION_NOT_TAKEN = """
import numpy as np
import equinox_shard as eqxs
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

devices = jax.devices()
single = jax.sharding.make_single_device_sharding
auto = (AxisType.Auto,)
eight = jax.make_mesh((8,), ("x",), axis_types=auto)
one = jax.make_mesh((1,), ("a",), devices=[devices[3]], axis_types=auto)
square = Mesh(np.array([[devices[3]]]), ("a", "b"), axis_types=(AxisType.Explicit,) * 2)
targets = {
    "Device": devices[3],
    "one-device sharding": single(devices[3]),
    "1-device mesh P()": NamedSharding(one, P()),
    "1-device mesh P(a)": NamedSharding(one, P("a")),
    "1-device mesh P(None, a)": NamedSharding(one, P(None, "a")),
    "1x1 mesh P(a, b)": NamedSharding(square, P("a", "b")),
    "1x1 mesh P()": NamedSharding(square, P()),
    "1x1 mesh P((a, b))": NamedSharding(square, P(("a", "b"))),
    "device 0": single(devices[0]),
    "device 0, pinned_host": single(devices[0], memory_kind="pinned_host"),
    "device 3, pinned_host": single(devices[3], memory_kind="pinned_host"),
    "device 0, unpinned_host": single(devices[0], memory_kind="unpinned_host"),
}
value = lambda: jnp.arange(64.0).reshape(8, 8)
sources = {
    "device 0": lambda: jax.device_put(value(), devices[0]),
    "uncommitted": value,
    "replicated": lambda: jax.device_put(value(), NamedSharding(eight, P())),
    "split": lambda: jax.device_put(value(), NamedSharding(eight, P("x"))),
}
buffers = lambda a: {s.data.unsafe_buffer_pointer() for s in a.addressable_shards}
results = {}
for source in sources:
    for target in targets:
        if "host" in target and source in ("replicated", "split"):
            continue  # XLA's "Memory kind mismatch", as `jax.device_put` gives
        x = sources[source]()
        expected = np.array(x, copy=True)
        y = eqxs.filter_device_put(x, targets[target], donate=True)
        name = f"{source} onto {target}"
        print(name, flush=True)  # the last line before a crash names its case
        if x.is_deleted() or y is x:
            results[name] = "donated"
            continue
        shared = bool(buffers(x) & buffers(y))
        eqxs.filter_jit(lambda a: a * 2, donate="all")(x)
        results[name] = [
            shared,
            y.is_deleted(),
            not y.is_deleted() and np.array_equal(np.asarray(y), expected),
        ]
report(results)
"""


def test_a_donation_not_taken_is_a_copy():
    run = run_isolated(_DONATION_NOT_TAKEN, timeout=300)
    assert run.returncode == 0, run
    assert len(run.result) == 42, run
    kept = {k: v for k, v in run.result.items() if v != "donated"}
    assert kept, run.result
    assert {k: v for k, v in kept.items() if v != [False, False, True]} == {}


@pytest.mark.parametrize("where", ["argument", "closed over"])
def test_an_input_donated_while_the_launch_waits_is_named(where):
    # A donating call checks its inputs again under `dispatch_lock` (the arrays its
    # function closes over too): another thread may have donated one since its first
    # look. Here the lock is held while the array is deleted, as such a thread would.
    w, x = jnp.arange(4.0), jnp.arange(4.0) + 1
    f = eqxs.filter_jit(eqx.Partial(lambda w, x: w * x, w), donate="all-except-first")
    outcome = []
    with dispatch_lock:
        worker = threading.Thread(target=lambda: outcome.append(_outcome(f, x)))
        worker.start()
        deadline = time.monotonic() + 60
        while not _waits_to_launch(sys._current_frames().get(worker.ident or 0)):
            assert worker.is_alive() and time.monotonic() < deadline, outcome
            time.sleep(0.001)
        {"argument": x, "closed over": w}[where].delete()
    worker.join()
    (error,) = outcome
    assert isinstance(error, RuntimeError), error
    name = {
        "argument": "args[0]: this array",
        "closed over": "fun.args[0]: this array of",
    }
    assert str(error).startswith(name[where]), error
    assert "has been deleted (was it donated to an earlier call?)" in str(error), error
    assert not {"argument": w, "closed over": x}[where].is_deleted()


def _outcome(f, *args):
    try:
        return f(*args)
    except Exception as e:
        return e


def _waits_to_launch(frame) -> bool:
    """Whether a thread waits for `dispatch_lock` in a donating entry's launch."""
    while frame is not None:
        line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
        if frame.f_code.co_name == "dispatch" and line.strip() == "with dispatch_lock:":
            return True
        frame = frame.f_back
    return False
