"""`filter_jit` passes its shardings to `jax.jit` and its arguments in the user's own
structure: `jax.eval_shape` and `.lower()` report `out_shardings`, JAX's own errors name
the user's arguments, committed mismatches are raised before tracing, and compiled
state is released with the wrapper."""

import functools as ft
import gc

import equinox as eqx
import equinox_shard as eqxs
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from .helpers import auto_mesh, explicit_mesh
from .isolated import run_isolated


@pytest.mark.parametrize(
    "make_mesh", [auto_mesh, explicit_mesh], ids=["auto", "explicit"]
)
@pytest.mark.xfail(
    strict=True,
    reason="`jax.eval_shape(f)` is `f.trace(...).out_info` only if `type(f) is "
    "PjitFunction`, else `jax.jit(f).trace(...).out_info`: a `jax.jit` with "
    "`out_shardings` nested in it does not set the outer output's sharding (JAX "
    "0.10.2 and 0.12; also for plain nested `jax.jit`). Use `f.eval_shape`.",
)
def test_eval_shape_reports_out_shardings(make_mesh):
    s = NamedSharding(make_mesh(), P("x"))
    f = eqxs.filter_jit(lambda a, k: (a * k, "tag"), out_shardings=(s, None))
    x = jnp.arange(64.0)
    out, tag = eqx.filter_eval_shape(f, x, 2)
    assert tag == "tag"
    assert out.shape == (64,)
    assert out.sharding is not None and out.sharding.is_equivalent_to(s, 1)
    out = jax.eval_shape(lambda a: f(a, 2)[0], x)
    assert out.sharding is not None and out.sharding.is_equivalent_to(s, 1)


@pytest.mark.parametrize(
    "make_mesh", [auto_mesh, explicit_mesh], ids=["auto", "explicit"]
)
def test_eval_shape_method_reports_out_shardings(make_mesh):
    s = NamedSharding(make_mesh(), P("x"))
    f = eqxs.filter_jit(lambda a, k: (a * k, "tag"), out_shardings=(s, None))
    out, tag = f.eval_shape(jax.ShapeDtypeStruct((64,), jnp.float32), 2)
    assert tag == "tag"
    assert out.shape == (64,)
    assert out.sharding is not None and out.sharding.is_equivalent_to(s, 1)
    out, tag = f.eval_shape(jnp.arange(64.0), 2)  # concrete arrays: nothing runs
    assert out.sharding.is_equivalent_to(s, 1)


@pytest.mark.parametrize(
    "make_mesh", [auto_mesh, explicit_mesh], ids=["auto", "explicit"]
)
def test_lower_reports_out_shardings(make_mesh):
    s = NamedSharding(make_mesh(), P("x"))
    f = eqxs.filter_jit(lambda a: {"y": a + 1}, out_shardings={"y": s})
    lowered = f.lower(jax.ShapeDtypeStruct((64,), jnp.float32))
    assert "sharding" in lowered.as_text()
    compiled = lowered.compile()
    assert compiled.output_shardings["y"].is_equivalent_to(s, 1)
    out = compiled(jnp.arange(64.0))
    assert out["y"].sharding.is_equivalent_to(s, 1)
    np.testing.assert_array_equal(out["y"], np.arange(64.0) + 1)


class _Layer(eqx.Module):
    weight: jax.Array
    name: str = "layer"


class _Model(eqx.Module):
    layers: tuple


def test_jax_error_names_mixed_device_sets():
    batch = NamedSharding(auto_mesh(), P("x"))
    model = _Model((_Layer(jax.device_put(jnp.ones(8), jax.devices()[3])),))

    @eqxs.filter_jit
    def forward(model, x):
        return model.layers[0].weight * x

    x = jax.device_put(jnp.arange(8.0), batch)
    with pytest.raises(ValueError, match="incompatible devices") as info:
        forward(model, x)
    message = str(info.value)
    assert "model.layers[0].weight" in message, message
    assert "kept[" not in message and "donated[" not in message


def test_jax_error_names_tracer_in_control_flow():
    @eqxs.filter_jit
    def f(params, x):
        if params["threshold"] > 0:
            return x
        return -x

    with pytest.raises(jax.errors.TracerBoolConversionError) as info:
        f({"threshold": jnp.array(1.0), "scale": 2.0}, jnp.ones(3))
    assert "params['threshold']" in str(info.value), str(info.value)


@pytest.mark.parametrize(
    "make, path",
    [
        (lambda w: _Model((_Layer(w),)), "arg.layers[0].weight"),
        (lambda w: (_Layer(w), 1.0), "arg[0].weight"),
        (lambda w: [{"a": _Layer(w)}], "arg[0]['a'].weight"),
    ],
    ids=["module", "tuple", "list"],
)
def test_jax_error_names_a_leaf_of_each_packed_form(make, path):
    # A parameter goes to `jax.jit` flat, as a namedtuple named by key paths or (paths
    # not starting with an attribute) a `Named`: JAX's message names it either way.
    @eqxs.filter_jit
    def f(arg):
        if jax.tree.leaves(arg)[0].sum() > 0:
            return 1
        return 0

    with pytest.raises(jax.errors.TracerBoolConversionError) as info:
        f(make(jnp.ones(2)))
    assert path in str(info.value), str(info.value)


def test_module_and_keyword_only_arguments_keep_their_values():
    # Each parameter is packed from its own leaves; a keyword-only argument's come
    # after every positional argument's, as `(args, kwargs)` flattens.
    @eqxs.filter_jit
    def f(model, x, *, y):
        return model.layers[0].weight + 10 * x + 100 * y

    model = _Model((_Layer(jnp.ones(2)),))
    out = f(model, jnp.full(2, 2.0), y=jnp.full(2, 3.0))
    assert out.tolist() == [321.0, 321.0]


def test_jax_error_names_wrong_shape_to_compiled():
    f = eqxs.filter_jit(lambda model, x: model.layers[0].weight + x)
    model = _Model((_Layer(jnp.ones(8)),))
    compiled = f.lower(model, jnp.ones(8)).compile()
    with pytest.raises((TypeError, ValueError)) as info:
        compiled(_Model((_Layer(jnp.ones(4)),)), jnp.ones(8))
    message = str(info.value)
    assert "model.layers[0].weight" in message, message
    assert "donated[" not in message and "kept[" not in message


def test_committed_elsewhere_moved_before_tracing():
    # Moved before the function is traced: `jax.shard_map` inside it sees its input
    # on the sharding that `in_shardings` asked for.
    s = NamedSharding(auto_mesh(), P("x"))
    traces = []

    @eqxs.filter_jit(in_shardings=(s,))
    def f(params):
        traces.append(1)
        return jax.shard_map(
            lambda w: w * 2, mesh=s.mesh, in_specs=P("x"), out_specs=P("x")
        )(params["w"])

    w = jax.device_put(jnp.arange(8.0), jax.devices()[1])
    out = f({"w": w})
    assert traces == [1]
    assert out.sharding.is_equivalent_to(s, 1)
    assert np.array_equal(np.asarray(out), np.arange(8.0) * 2)
    assert w.sharding == jax.sharding.make_single_device_sharding(jax.devices()[1])


def _rss_mib() -> float:
    with open("/proc/self/status") as file:
        for line in file:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")  # pragma: no cover


@pytest.mark.slow
def test_fresh_partials_release_compiled_state():
    # Each wrapper compiles once; none may outlive its wrapper. 1000 compilations of
    # a small function grew the process by ~1.4 GiB when caches outlived wrappers.
    def f(x, k):
        return x * k + 1

    x = jnp.arange(8.0)
    for i in range(50):  # warm-up: allocator pools, JAX's own caches
        eqxs.filter_jit(ft.partial(f, k=float(i)))(x).block_until_ready()
    gc.collect()
    before = _rss_mib()
    for i in range(1000):
        out = eqxs.filter_jit(ft.partial(f, k=float(i)))(x)
        if i % 250 == 0:
            np.testing.assert_allclose(out, np.arange(8.0) * i + 1)
    gc.collect()
    growth = _rss_mib() - before
    assert growth < 150, growth


def test_equal_decorations_share_after_the_first_is_gone():
    # As `eqx.filter_jit`: a fresh but equal wrapper (a bound method, a re-created
    # `filter_grad`, an equal Module) does not retrace, even once the first is gone.
    traces = []

    def f(x, k):
        traces.append(None)
        return x * k

    x = jnp.arange(4.0)
    eqxs.filter_jit(eqx.Partial(f, k=2.0))(x)
    gc.collect()
    eqxs.filter_jit(eqx.Partial(f, k=2.0))(x)
    assert len(traces) == 1

    def g(x):
        return jnp.sum(f(x, 3.0))

    eqxs.filter_jit(eqx.filter_grad(g))(x)
    gc.collect()
    eqxs.filter_jit(eqx.filter_grad(g))(x)
    assert len(traces) == 2


def test_clear_caches_clears_ours():
    traces = []

    @eqxs.filter_jit
    def f(x):
        traces.append(None)
        return x + 1

    x = jnp.arange(4.0)
    f(x)
    f(x)
    assert len(traces) == 1
    eqx.clear_caches()
    f(x)
    assert len(traces) == 2


def test_one_numpy_value_donated_twice():
    # Found by tests/test_nothing_lost.py: NumPy inputs are copied onto the device by
    # every call, so one reachable twice needs no private copy.
    f = eqxs.filter_jit(lambda a, b: a + b, donate="all")
    x = np.float32(1.0)
    assert f(x, x) == 2
    assert f.lower(x, x).compile()(x, x) == 2


class _Private(eqx.Module):
    _weight: jax.Array
    bias: jax.Array
    name: str = eqx.field(static=True)


def test_out_shardings_module_prefix_with_private_and_static_fields():
    mesh = auto_mesh()
    rows, replicated = NamedSharding(mesh, P("x")), NamedSharding(mesh, P())

    @eqxs.filter_jit(
        out_shardings=(_Private(rows, replicated, "out"), replicated)  # pyright: ignore
    )
    def f(m, x):
        return _Private(m._weight * 2, m.bias + 1, "out"), (x, "tag")

    m = _Private(jnp.arange(16.0).reshape(8, 2), jnp.ones(2), "in")
    out, (x, tag) = f(m, jnp.ones(8))
    assert out.name == "out" and tag == "tag"
    assert out._weight.sharding.is_equivalent_to(rows, 2)
    assert out.bias.sharding.is_equivalent_to(replicated, 1)
    assert x.sharding.is_equivalent_to(replicated, 1)
    assert jnp.array_equal(out._weight, jnp.arange(16.0).reshape(8, 2) * 2)


def test_jax_error_names_private_field():
    @eqxs.filter_jit
    def f(m):
        if m._weight.sum() > 0:
            return m.bias
        return -m.bias

    with pytest.raises(jax.errors.TracerBoolConversionError) as info:
        f(_Private(jnp.ones(2), jnp.ones(2), "a"))
    assert "m._weight" in str(info.value), str(info.value)


def test_jax_error_points_at_the_users_function():
    @eqxs.filter_jit(out_shardings=lambda x: None)
    def user_function(x):
        if x.sum() > 0:
            return x
        return -x

    for f in (eqxs.filter_jit(user_function.__wrapped__), user_function):
        with pytest.raises(jax.errors.TracerBoolConversionError) as info:
            f(jnp.ones(2))
        message = str(info.value)
        assert (
            f"test_jit_core.py:{user_function.__wrapped__.__code__.co_firstlineno}"
            in message
        ), message
        assert "_jit/entry.py" not in message, message


@pytest.mark.devices(2, reason="inputs committed to other devices than the call's")
@pytest.mark.parametrize("sharded", [False, True], ids=["plain", "in_shardings"])
def test_a_warm_call_of_other_arguments_is_looked_up(sharded):
    # A warm call runs the last call's entry as it is only for its structure, static
    # part and leaf types (`filter_jit`'s step 0); every other call is looked up.
    one = jax.make_mesh(
        (1,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1]
    )
    fn = lambda a, k: (a * k, type(k).__name__)
    if sharded:
        f = eqxs.filter_jit(fn, in_shardings=NamedSharding(one, P()))
    else:
        f = eqxs.filter_jit(fn)
    x = jnp.arange(3.0)
    outs = [f(x, 2) for _ in range(3)]
    assert [name for _, name in outs] == ["int"] * 3
    for out, _ in outs:
        np.testing.assert_array_equal(out, [0.0, 2.0, 4.0])
    # An array where the static leaf was (equal to it) is traced.
    assert f(x, np.array(2.0, np.float32))[1] == "DynamicJaxprTracer"
    np.testing.assert_array_equal(f(x, 3)[0], [0.0, 3.0, 6.0])
    np.testing.assert_array_equal(f(np.arange(3.0), 2)[0], [0.0, 2.0, 4.0])
    assert f(jnp.arange(5.0), 2)[0].shape == (5,)
    y = jax.device_put(jnp.arange(3.0), jax.devices()[1])
    out, _ = f(y, 2)
    np.testing.assert_array_equal(out, [0.0, 2.0, 4.0])
    assert not y.is_deleted()
    np.testing.assert_array_equal(y, np.arange(3.0))
    if sharded:
        # Inputs on their targets run it as they are; one committed elsewhere (to
        # two devices, which `jax.jit` refuses) is looked up, and moved.
        on = jax.device_put(jnp.arange(3.0), NamedSharding(one, P()))
        two = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
        y = jax.device_put(jnp.arange(3.0), NamedSharding(two, P()))
        for _ in range(3):
            np.testing.assert_array_equal(f(on, 2)[0], [0.0, 2.0, 4.0])
        np.testing.assert_array_equal(f(y, 2)[0], [0.0, 2.0, 4.0])
        np.testing.assert_array_equal(y, np.arange(3.0))
        for _ in range(2):
            np.testing.assert_array_equal(f(on, 2)[0], [0.0, 2.0, 4.0])
        np.testing.assert_array_equal(f(on, 3)[0], [0.0, 3.0, 6.0])
        assert f(jax.device_put(jnp.arange(5.0), NamedSharding(one, P())), 2)[
            0
        ].shape == (5,)
    f(x, 2)
    z = jnp.arange(3.0)
    z.delete()
    with pytest.raises(RuntimeError, match=r"^a: this array has been deleted"):
        f(z, 2)
    np.testing.assert_array_equal(f(x, 2)[0], [0.0, 2.0, 4.0])
    # NumPy inputs run it too; an array where the static leaf was is traced there.
    v = np.arange(3.0, dtype=np.float32)
    for _ in range(3):
        np.testing.assert_array_equal(f(v, 2)[0], [0.0, 2.0, 4.0])
    assert f(v, np.array(2.0, np.float32))[1] == "DynamicJaxprTracer"
    np.testing.assert_array_equal(f(v, 3)[0], [0.0, 3.0, 6.0])
    np.testing.assert_array_equal(v, np.arange(3.0))


class _Scale:
    """A static leaf hashed by its value, which a user may change in place."""

    def __init__(self, value: float):
        self.value = value

    def __eq__(self, other):
        return isinstance(other, _Scale) and other.value == self.value

    def __hash__(self):
        return hash(self.value)


class _AlwaysEqual(_Scale):
    """Equal to every `_Scale`, hashed by identity: `==` alone cannot tell two apart."""

    def __eq__(self, other):
        return isinstance(other, _Scale)

    __hash__ = object.__hash__


def test_a_warm_call_sees_its_static_leaves_as_a_look_up_would():
    # `filter_jit`'s step 0 compares the static part with the last call's as the cache's
    # look-up does (hash, then `==`): a static leaf changed in place since, or one equal
    # to it but hashed otherwise, is another entry, whether or not step 0 runs (the
    # third call; `eqx.filter_jit` and `jax.jit`'s static arguments answer either way,
    # by version).
    fn = lambda x, s: x * s.value
    x = jnp.ones(())
    for make in (_Scale, _AlwaysEqual):
        f = eqxs.filter_jit(fn)
        first = make(2.0)
        got = [float(f(x, first)) for _ in range(2)]
        if make is _Scale:
            first.value = 7.0
            got.append(float(f(x, first)))
        else:
            got.append(float(f(x, make(7.0))))
        assert got == [2.0, 2.0, 7.0], (make.__name__, got)


@pytest.mark.devices(2, reason="the pace is of launches on several CPU devices")
@pytest.mark.cpu(reason="the pace is of the CPU client's queue")
def test_every_pace_th_launch_on_several_cpu_devices_waits_for_its_outputs(
    monkeypatch,
):
    from equinox_shard._jit import launch

    waited = []
    monkeypatch.setattr(jax, "block_until_ready", lambda x: waited.append(x) or x)
    f = eqxs.filter_jit(lambda x: x + 1, in_shardings=NamedSharding(auto_mesh(), P()))
    outs = [f(jnp.ones(8)) for _ in range(2 * launch.PACE)]
    ours = [x for arrays in waited for x in arrays if any(x is y for y in outs)]
    assert len(ours) == 2


@pytest.mark.devices(2, reason="an input committed to two devices, off its target")
def test_a_warm_call_with_a_placed_model_and_a_fresh_batch():
    # Step 0 runs a call whose committed inputs are on their targets and the others
    # uncommitted (`Typed`); a committed input off its target is looked up, and moved.
    one = jax.make_mesh(
        (1,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1]
    )
    two = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    target = NamedSharding(one, P())
    f = eqxs.filter_jit(lambda w, x: w * x, in_shardings=(target, target))
    w = jax.device_put(jnp.full(3, 2.0, jnp.float32), target)
    for _ in range(3):
        np.testing.assert_array_equal(f(w, jnp.arange(3.0)), [0.0, 2.0, 4.0])
    elsewhere = jax.device_put(jnp.full(3, 3.0, jnp.float32), NamedSharding(two, P()))
    np.testing.assert_array_equal(f(elsewhere, jnp.arange(3.0)), [0.0, 3.0, 6.0])
    np.testing.assert_array_equal(elsewhere, [3.0, 3.0, 3.0])
    np.testing.assert_array_equal(f(w, jnp.arange(3.0)), [0.0, 2.0, 4.0])


def test_step_0_on_several_devices_checks_its_inputs_under_the_lock():
    # On several CPU devices step 0 launches under `dispatch_lock` (`launch.paced_run`),
    # checking its inputs again there: another thread may have donated one since. In a
    # fresh process: a deleted multi-device input can kill it (JAX 0.10.2,
    # upstream/jax-reports/deleted-multidevice-input).
    run = run_isolated(
        """
import linecache, sys, threading, time
import equinox_shard as eqxs
import jax.numpy as jnp
from equinox_shard._dispatch import dispatch_lock
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
rep, row = NamedSharding(mesh, P()), NamedSharding(mesh, P("x"))
f = eqxs.filter_jit(lambda w, x: w * x, in_shardings=(rep, row))
w = jax.device_put(jnp.full((8,), 2.0), rep)
x = jax.device_put(jnp.ones(8), row)
for _ in range(3):
    jax.block_until_ready(f(w, x))

def waits(frame):
    while frame is not None:
        line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
        if frame.f_code.co_name == "paced_run" and "dispatch_lock" in line:
            return True
        frame = frame.f_back
    return False

outcome = []
def work(x):
    try:
        outcome.append(repr(f(w, x)))
    except Exception as e:
        outcome.append(f"{type(e).__name__}: {e}")

with dispatch_lock:
    worker = threading.Thread(target=work, args=(x,))
    worker.start()
    deadline = time.monotonic() + 120
    while not waits(sys._current_frames().get(worker.ident)):
        assert worker.is_alive() and time.monotonic() < deadline, outcome
        time.sleep(0.001)
    w.delete()
worker.join()
report({"outcome": outcome, "x alive": not x.is_deleted()})
""",
        timeout=300,
    )
    assert run.returncode == 0, run
    (outcome,) = run.result["outcome"]
    assert outcome.startswith("RuntimeError: w: this array has been deleted"), run
    assert run.result["x alive"], run
