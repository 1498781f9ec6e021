"""`eqx.error_if` (a raising `jax.pure_callback`) inside a `filter_jit` that spans
several devices: it raises `eqx.EquinoxRuntimeError` promptly and the process lives on.

Before the fix, the partition running the callback failed and the others waited in a
collective until XLA aborted the process (~40 s, exit 134), so each firing case runs in
a child process (`run_isolated`) with a deadline.
"""

import equinox as eqx
import equinox_shard as eqxs
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from .helpers import auto_mesh, count_compiles
from .isolated import run_isolated


# Runs `body` (which defines `f` and an input `x`), then times the firing call and
# makes a later call; reports what happened.
_SETUP = """
import time
import equinox as eqx
import equinox_shard as eqxs
import jax.numpy as jnp
import jax.random as jr
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

def fire(call):
    start = time.monotonic()
    try:
        call()
    except Exception as e:
        return {"type": type(e).__name__, "msg": str(e),
                "seconds": time.monotonic() - start}
    return {"type": None, "msg": "", "seconds": time.monotonic() - start}
"""

_DEADLINE = 120
_PROMPT = 10.0  # seconds: the error must arrive well before XLA's 40 s abort.


def _check_fired(res, message="positive!", kind="EquinoxRuntimeError"):
    assert res.returncode == 0, res
    assert res.result is not None, res
    fired = res.result["fired"]
    assert fired["type"] == kind, res
    assert message in fired["msg"], res
    assert fired["seconds"] < _PROMPT, res
    return res.result


def _mesh_code(kind):
    return f'mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.{kind},))\n'


def _simple(kind, set_mesh):
    code = _SETUP + _mesh_code(kind)
    if set_mesh:
        code += "jax.set_mesh(mesh)\n"
    return (
        code
        + """
@eqxs.filter_jit
def f(x):
    return eqx.error_if(x, x > 0, "positive!")

x = eqxs.filter_device_put(jnp.ones((8,)), NamedSharding(mesh, P("d")))
fired = fire(lambda: f(x))
ok = f(-x)
report({"fired": fired, "later": ok.tolist(), "n": len(ok.sharding.device_set)})
"""
    )


def test_fires_multi_device_auto():
    res = _check_fired(run_isolated(_simple("Auto", False), timeout=_DEADLINE))
    assert res["later"] == [-1.0] * 8
    assert res["n"] == 8


def test_fires_multi_device_explicit():
    res = _check_fired(run_isolated(_simple("Explicit", True), timeout=_DEADLINE))
    assert res["later"] == [-1.0] * 8
    assert res["n"] == 8


def test_fires_with_in_shardings_and_donation():
    code = (
        _SETUP
        + _mesh_code("Auto")
        + """
s = NamedSharding(mesh, P("d"))

@eqxs.filter_jit(in_shardings=s, out_shardings=s, donate="all")
def f(x):
    return eqx.error_if(x * 2, x > 0, "positive!")

fired = fire(lambda: f(jnp.ones((8,))))
ok = f(-jnp.ones((8,)))
report({"fired": fired, "later": ok.tolist(), "n": len(ok.sharding.device_set)})
"""
    )
    res = _check_fired(run_isolated(code, timeout=_DEADLINE))
    assert res["later"] == [-2.0] * 8
    assert res["n"] == 8


def test_fires_with_one_buffer_donated_and_kept():
    # The donated occurrence is a private copy (a separate compiled entry): that entry
    # guards its callbacks too.
    code = (
        _SETUP
        + _mesh_code("Auto")
        + """
f = eqxs.filter_jit(lambda a, b: eqx.error_if(a + b, a > 0, "positive!"),
                    donate="all-except-first")
x = eqxs.filter_device_put(jnp.ones((8,)), NamedSharding(mesh, P("d")))
fired = fire(lambda: f(x, x))
y = -x
ok = f(y, y)
report({"fired": fired, "later": ok.tolist(), "alive": not x.is_deleted()})
"""
    )
    res = _check_fired(run_isolated(code, timeout=_DEADLINE))
    assert res["later"] == [-2.0] * 8
    assert res["alive"]


def test_fires_in_compiled_object():
    # `filter_jit(f).lower(...).compile()` runs its callbacks guarded too.
    code = (
        _SETUP
        + _mesh_code("Auto")
        + """
batch = NamedSharding(mesh, P("d"))
f = eqxs.filter_jit(
    lambda x: eqx.error_if(x, x.sum() > 0, "positive!"), in_shardings=batch
)
x = eqxs.filter_device_put(jnp.ones((8,)), batch)
compiled = f.lower(x).compile()
fired = fire(lambda: compiled(x))
ok = compiled(-x)
report({"fired": fired, "later": ok.tolist()})
"""
    )
    res = _check_fired(run_isolated(code, timeout=_DEADLINE))
    assert res["later"] == [-1.0] * 8


@pytest.mark.slow  # the other `fires_*` tests take the same path on smaller bodies
def test_fires_in_mlp_forward():
    code = (
        _SETUP
        + _mesh_code("Auto")
        + """
mlp = eqx.nn.MLP(4, 3, 16, 2, key=jr.key(0))
mlp = eqxs.filter_device_put(mlp, NamedSharding(mesh, P()))

@eqxs.filter_jit
def forward(model, xs):
    out = jax.vmap(model)(xs)
    return eqx.error_if(out, ~jnp.isfinite(out), "non-finite output!")

xs = eqxs.filter_device_put(jnp.ones((16, 4)), NamedSharding(mesh, P("d")))
bad = xs.at[3, 0].set(jnp.nan)
fired = fire(lambda: forward(mlp, bad))
ok = forward(mlp, xs)
report({"fired": fired, "later": bool(jnp.all(jnp.isfinite(ok)))})
"""
    )
    res = _check_fired(run_isolated(code, timeout=_DEADLINE), "non-finite output!")
    assert res["later"]


def test_fires_in_scan_and_vmap_and_nested():
    code = (
        _SETUP
        + _mesh_code("Auto")
        + """
@eqxs.filter_jit
def scanned(x):
    def body(c, row):
        c = eqx.error_if(c + row, c + row > 2, "too big in scan!")
        return c, c
    return lax.scan(body, jnp.zeros(8), x)

@eqxs.filter_jit
def vmapped(x):
    return jax.vmap(lambda r: eqx.error_if(r, r > 0, "positive in vmap!"))(x)

@eqxs.filter_jit
def inner(x):
    return eqx.error_if(x, x > 0, "positive in inner!")

@eqxs.filter_jit
def outer(x):
    return inner(x * 2) + 1

x = eqxs.filter_device_put(jnp.ones((4, 8)), NamedSharding(mesh, P(None, "d")))
y = eqxs.filter_device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("d")))
report({
    "scan": fire(lambda: scanned(x)),
    "vmap": fire(lambda: vmapped(y)),
    "nested": fire(lambda: outer(y)),
    "later": [float(scanned(x / 4)[0][0]), float(vmapped(-y).sum()),
              float(outer(-y).sum())],
})
"""
    )
    res = run_isolated(code, timeout=_DEADLINE)
    assert res.returncode == 0, res
    assert res.result is not None, res
    for name, message in [
        ("scan", "too big in scan!"),
        ("vmap", "positive in vmap!"),
        ("nested", "positive in inner!"),
    ]:
        fired = res.result[name]
        assert fired["type"] == "EquinoxRuntimeError", res
        assert message in fired["msg"], res
        assert fired["seconds"] < _PROMPT, res
    assert res.result["later"] == [1.0, -32.0, -32.0]


def test_message_and_stack_as_single_device():
    # The message is Equinox's, with the stack inside JIT, as on one device.
    code = (
        _SETUP
        + _mesh_code("Auto")
        + """
@eqxs.filter_jit
def f(x):
    return eqx.error_if(x, x > 0, "positive!")

one = fire(lambda: f(jax.device_put(jnp.ones(8), jax.devices()[0])))
many = fire(lambda: f(eqxs.filter_device_put(jnp.ones(8), NamedSharding(mesh, P("d")))))
report({"fired": many, "one": one})
"""
    )
    res = _check_fired(run_isolated(code, timeout=_DEADLINE))
    one, many = res["one"], res["fired"]
    assert one["type"] == "EquinoxRuntimeError"
    assert many["msg"] == one["msg"]
    assert "Below is the stack inside of JIT" in many["msg"]
    assert ", in f\n" in many["msg"]  # The frame of `f` that called `error_if`.


def test_other_callback_raising():
    # A user's raising `pure_callback`: a `JaxRuntimeError` naming the exception.
    code = (
        _SETUP
        + _mesh_code("Auto")
        + """
import numpy as np

def check(v):
    if np.any(v > 0):
        raise ValueError("user callback says no")
    return v

@eqxs.filter_jit
def f(x):
    return jax.pure_callback(check, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

x = eqxs.filter_device_put(jnp.ones((8,)), NamedSharding(mesh, P("d")))
fired = fire(lambda: f(x))
report({"fired": fired, "later": f(-x).tolist()})
"""
    )
    res = _check_fired(
        run_isolated(code, timeout=_DEADLINE),
        "ValueError: user callback says no",
        "JaxRuntimeError",
    )
    assert res["later"] == [-1.0] * 8


def test_concurrent_calls():
    # Each thread gets its own call's outcome.
    code = (
        _SETUP
        + _mesh_code("Auto")
        + """
from concurrent.futures import ThreadPoolExecutor

@eqxs.filter_jit
def f(x):
    return eqx.error_if(x, x > 0, "positive!")

s = NamedSharding(mesh, P("d"))
xs = [eqxs.filter_device_put(jnp.full((8,), (-1.0) ** i), s) for i in range(8)]
start = time.monotonic()
with ThreadPoolExecutor(4) as pool:
    outs = list(pool.map(lambda x: fire(lambda: f(x)), xs))
report({"types": [o["type"] for o in outs], "seconds": time.monotonic() - start})
"""
    )
    res = run_isolated(code, timeout=_DEADLINE)
    assert res.returncode == 0, res
    assert res.result["types"] == ["EquinoxRuntimeError", None] * 4, res
    assert res.result["seconds"] < _PROMPT, res


#
# Not firing: in process (nothing can hang).
#


def test_not_firing_values_match_unsharded(getkey):
    mesh = auto_mesh()
    mlp = eqx.nn.MLP(4, 3, 16, 2, key=getkey())
    xs = jr.normal(getkey(), (16, 4))

    def forward(model, xs):
        out = jax.vmap(model)(xs)
        return eqx.error_if(out, ~jnp.isfinite(out), "non-finite output!")

    expected = forward(mlp, xs)
    sharded_forward = eqxs.filter_jit(forward)
    for _ in range(2):
        out = sharded_forward(
            eqxs.filter_device_put(mlp, NamedSharding(mesh, P())),
            eqxs.filter_device_put(xs, NamedSharding(mesh, P("x"))),
        )
        assert len(out.sharding.device_set) == mesh.size
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


def test_under_transforms_and_disable_jit():
    # Called under `jax.jit`, `jax.vmap` or `jax.grad`, the function is traced, not run
    # by us: it keeps its values (the firing case is the outer transform's to handle).
    mesh = auto_mesh()

    @eqxs.filter_jit
    def f(x):
        return eqx.error_if(x * 3, x > 0, "positive!")

    x = eqxs.filter_device_put(-jnp.ones((8,)), NamedSharding(mesh, P("x")))
    assert f(x).tolist() == [-3.0] * 8
    assert jax.jit(f)(x).tolist() == [-3.0] * 8
    assert jax.vmap(f)(x.reshape(8, 1)).ravel().tolist() == [-3.0] * 8
    assert jax.grad(lambda x: f(x).sum())(x).tolist() == [3.0] * 8
    with jax.disable_jit():
        assert f(x).tolist() == [-3.0] * 8


def _error_if_body(x):
    return eqx.error_if(x, jnp.any(jnp.isnan(x)), "nan") * 2


def _debug_callback_body(x):
    jax.debug.callback(lambda v: None, x)
    return x * 2


def _pure_callback_body(x):
    shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return jax.pure_callback(lambda v: np.asarray(v) * 2, shape, x)


_NEW_SHAPES = [
    lambda: jnp.full(8, 3.0),
    lambda: jnp.full(8, 3, jnp.int32),
    lambda: jnp.full((8, 10), 1.5),
    lambda: jnp.full(8, 3.0),
    lambda: np.full(8, 4.0, np.float32),
]


@pytest.mark.parametrize(
    "body", [_error_if_body, _debug_callback_body, _pure_callback_body]
)
def test_callback_entry_follows_new_shapes_and_dtypes(body):
    # One wrapper, called with a new dtype, then a new shape, then the first again:
    # each call as `eqx.filter_jit` computes it (a guarded program per traced one).
    f, oracle = eqxs.filter_jit(body), eqx.filter_jit(body)
    for make in _NEW_SHAPES:
        out, expected = f(make()), oracle(make())
        assert (out.dtype, out.shape) == (expected.dtype, expected.shape)
        assert out.weak_type == expected.weak_type
        np.testing.assert_array_equal(np.array(out), np.array(expected))


@pytest.mark.parametrize(
    "body", [_error_if_body, _debug_callback_body, _pure_callback_body]
)
def test_compiled_with_callbacks_runs_its_own_executable(body):
    # `.lower(...).compile()` compiles the program calls run (the guarded one), so a
    # call compiles nothing, as `eqx.filter_jit`'s `Compiled` does.
    x = jnp.full(8, 3.0)
    compiled = eqxs.filter_jit(body).lower(x).compile()
    with count_compiles() as compiles:
        outs = [compiled(x), compiled(x)]
    assert compiles == []
    for out in outs:
        np.testing.assert_array_equal(np.array(out), np.full(8, 6.0, np.float32))
    if body is _error_if_body:
        with pytest.raises(eqx.EquinoxRuntimeError, match="nan"):
            compiled(jnp.full(8, np.nan))


@pytest.mark.parametrize(
    "body", [_error_if_body, _debug_callback_body, _pure_callback_body]
)
@pytest.mark.parametrize("weak", [True, False])
def test_callbacks_trace_as_often_as_jax_jit_on_uncommitted_inputs(body, weak):
    # Found by tests/test_differential.py: with a weak-typed uncommitted input, the
    # first call ran the guarded program on its inputs as given and every later call on
    # placed ones, so the function was traced twice where `jax.jit` traces it once.
    replicated = NamedSharding(auto_mesh(), P())
    traces = {"ours": 0, "jax.jit": 0}

    def counted(name):
        def fn(x):
            traces[name] += 1
            return body(x)

        return fn

    ours = eqxs.filter_jit(
        counted("ours"), in_shardings=replicated, out_shardings=replicated
    )
    oracle = jax.jit(
        counted("jax.jit"), in_shardings=replicated, out_shardings=replicated
    )
    make = lambda: jnp.asarray(1.5) if weak else jnp.asarray(np.float32(1.5))
    for _ in range(3):
        out, expected = ours(make()), oracle(make())
        assert jax.typeof(out) == jax.typeof(expected)
        assert out.sharding.is_equivalent_to(expected.sharding, 0)
        assert float(out) == float(expected) == 3.0
    assert traces == {"ours": 1, "jax.jit": 1}


def test_callback_entry_follows_new_shapes_sharded():
    # On 8 devices a stale program crashed the process (SIGSEGV): in a child.
    result = run_isolated(
        """
        import equinox as eqx, equinox_shard as eqxs, jax.numpy as jnp, numpy as np
        from jax.sharding import NamedSharding, PartitionSpec as P

        mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
        s = NamedSharding(mesh, P())
        body = lambda x: eqx.error_if(x, jnp.any(jnp.isnan(x)), "nan") * 2
        f = eqxs.filter_jit(body, in_shardings=s, out_shardings=s)
        oracle = eqx.filter_jit(body)
        same = []
        for x in [jnp.full(8, 3.0), jnp.full(8, 3, jnp.int32), jnp.full((8, 10), 1.5)]:
            out, expected = f(x), oracle(x)
            same.append(
                out.dtype == expected.dtype
                and out.shape == expected.shape
                and bool((np.array(out) == np.array(expected)).all())
                and out.sharding.is_equivalent_to(s, out.ndim)
            )
        report(same)
        """,
        timeout=300,
    )
    assert result.returncode == 0, result
    assert result.result == [True, True, True], result


def test_callback_entry_raises_for_a_new_shape():
    f = eqxs.filter_jit(_error_if_body)
    f(jnp.ones(4))
    with pytest.raises(eqx.EquinoxRuntimeError, match="nan"):
        f(jnp.full((4, 10), jnp.nan))
    assert f(jnp.ones((4, 10))).shape == (4, 10)
