"""Where two concerns meet: every pair of features of a `filter_jit` call, run together
on one wrapper, against `jax.jit` on the partitioned leaves.

The features: donation, a callback in the body (`eqx.error_if` and `jax.debug.print`),
calls from several threads, several devices (`in_shardings`/`out_shardings` on 8 CPU
devices), ahead-of-time `Compiled`, `Format(Layout.AUTO, ...)` with an input XLA prunes
(the bias, which the body does not use), JAX's `jax_explain_cache_misses`,
`jax.disable_jit`, an outer `jax.jit`/`jax.vmap`/`jax.grad`, and committed inputs that
must move. Each cell calls one wrapper at two sizes, one after the other, and checks:
no crash, nothing not donated deleted or changed (against an independent copy), values
equal to the oracle's, the non-array output the same object, warnings as errors. Cells
that could take the process down (a callback with threads, devices or donation) run in
a child process, whose return code is checked.
"""

import contextlib
import itertools as it
import os
import threading
import warnings

import equinox as eqx
import equinox_shard as eqxs
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from jax.experimental.layout import Format, Layout
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from .helpers import snapshot
from .isolated import run_isolated
from .strategies import cached_mesh


FEATURES = (
    "donate",
    "callback",
    "threads",
    "devices",
    "aot",
    "auto_format",
    "explain",
    "disable_jit",
    "outer",
    "move",
)
# Where an earlier defect killed the process: a callback with any of these.
_CRASH_PRONE = {"threads", "devices", "move", "auto_format", "donate", "aot"}
# The issue's own meetings of three (defect 1: donation, a callback, threads).
_TRIPLES = (
    ("donate", "callback", "threads"),
    ("donate", "callback", "devices"),
    ("callback", "threads", "devices"),
)
_SIZES = (8, 16)
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Linear(eqx.Module):
    weight: jax.Array
    bias: jax.Array  # never used by the body: XLA prunes it
    name: str = eqx.field(static=True)


def _body(callback: bool):
    def body(model, x):
        y = model.weight @ x
        if callback:
            y = eqx.error_if(y, jnp.any(jnp.isnan(y)), "nan in y")
            jax.debug.print("y[0] = {}", y[0])
        return y, model.name

    return body


def _host_inputs(n: int):
    rng = np.random.default_rng(n)
    weight = rng.standard_normal((n, n)).astype(np.float32)
    return weight, rng.standard_normal(n).astype(np.float32), rng.standard_normal(n)


def _inputs(n: int, placement):
    """A fresh model and input (independent buffers on every call). `placement` is None
    (uncommitted) or `(model_sharding, x_sharding)` to commit them to."""
    weight, x, bias = _host_inputs(n)
    model = _Linear(jnp.asarray(weight), jnp.asarray(bias, jnp.float32), "linear")
    x = jnp.asarray(x)
    if placement is not None:
        model, x = eqxs.filter_device_put((model, x), placement)
    return model, x


def _struct(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype) if eqx.is_array(x) else x


class _Cell:
    """One meeting of features: the wrapper under test and its `jax.jit` oracle."""

    def __init__(self, features):
        self.on = set(features)
        mesh = cached_mesh("1d", AxisType.Auto)
        rep, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("x"))
        self.sharded = bool(self.on & {"devices", "move", "auto_format"})
        self.targets = (rep, split) if self.sharded else None
        body = _body("callback" in self.on)
        kwargs = {}
        if self.sharded:
            first = Format(Layout.AUTO, rep) if "auto_format" in self.on else rep
            kwargs = dict(in_shardings=(first, split), out_shardings=rep)
        # The model (first argument) is never donated: it must survive every call.
        donate = "all-except-first" if "donate" in self.on else "none"
        self.ours = eqxs.filter_jit(body, donate=donate, **kwargs)

        def partitioned(dynamic_model, x):
            return body(eqx.combine(dynamic_model, self.static_model), x)[0]

        self.oracle = jax.jit(
            partitioned,
            in_shardings=self.targets,
            out_shardings=rep if self.sharded else None,
            donate_argnums=(1,) if "donate" in self.on else (),
        )
        # Inside an outer trace `Layout.AUTO` reaches `jax.jit` as it is (vmap refuses).
        self.outer_oracle = self.oracle
        if "auto_format" in self.on:
            self.outer_oracle = jax.jit(
                partitioned,
                in_shardings=(Format(Layout.AUTO, rep), split),
                out_shardings=rep,
            )
        self.static_model = None

    def _context(self):
        stack = contextlib.ExitStack()
        if "disable_jit" in self.on:
            stack.enter_context(jax.disable_jit())
        return stack

    def expected(self, n: int):
        model, x = _inputs(n, self.targets)
        dynamic, self.static_model = eqx.partition(model, eqx.is_array)
        with self._context(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Some donated buffers were not usable")
            return self.oracle(dynamic, x)

    def ours_callable(self, model, x):
        """What the user calls: the wrapper, or its `Compiled` (placed as the AUTO flow
        says), and the arguments to call it with."""
        if not self.on & {"aot", "auto_format"}:
            return self.ours, (model, x)
        lowered = self.ours.lower(*jtu.tree_map(_struct, (model, x)))
        compiled = lowered.compile()
        if "auto_format" in self.on:
            model, x = eqxs.filter_device_put((model, x), compiled.input_formats[0])
        return (compiled if "aot" in self.on else self.ours), (model, x)

    def run(self, n: int):
        placement = None
        if "move" in self.on:
            # Committed, each on the other's sharding: both must move.
            placement = (self.targets[1], self.targets[0])  # pyright: ignore
        model, x = _inputs(n, placement)
        before = snapshot((model, x))
        if "disable_jit" in self.on and self.on & {"aot", "auto_format"}:
            # The AOT flow under `disable_jit`: as `jax.jit`'s (lower, compile, call).
            oracle_model, oracle_x = _inputs(n, self.targets)
            dynamic, self.static_model = eqx.partition(oracle_model, eqx.is_array)

            def oracle_flow():
                lowered = self.oracle.lower(*jtu.tree_map(_struct, (dynamic, oracle_x)))
                return lowered.compile()(dynamic, oracle_x)

            def ours_flow():
                fn, args = self.ours_callable(model, x)
                return fn(*args)[0]

            with jax.disable_jit():
                want, got = _outcome(oracle_flow), _outcome(ours_flow)
            if isinstance(want, Exception):
                assert type(got) is type(want), (got, want)
            else:
                assert not isinstance(got, Exception), got
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
            return
        expected = _outcome(lambda: self.expected(n))
        with self._context():
            fn, args = self.ours_callable(model, x)
            if isinstance(expected, Exception):
                assert jax.default_backend() != "cpu", expected
                # JAX refuses it too (a TPU v5e with JAX 0.10.2, a callback in the
                # body: XLA's "RET_CHECK failure ... is live and cannot be removed").
                assert type(_outcome(lambda: fn(*args))) is type(expected), expected
                outs = []
            elif "threads" in self.on:
                outs = self._threads(fn, args)
            else:
                outs = [fn(*args)]
            for y, name in outs:
                assert name is model.name
                np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)  # pyright: ignore
            if "outer" in self.on and outs:
                self._outer(n)
        # The model was not donated: alive and unchanged, as the input given.
        for leaf, host in zip(jtu.tree_leaves(model), jtu.tree_leaves(before[0])):
            assert not leaf.is_deleted()
            np.testing.assert_array_equal(np.array(leaf, copy=True), host)
        if "donate" not in self.on:
            assert not x.is_deleted()
            np.testing.assert_array_equal(np.array(x, copy=True), before[1])

    def _threads(self, fn, args):
        """Four threads call with the very same arguments; with donation one of them
        may run and the others must get the named error for a deleted input."""
        outs, errors = [], []

        def work():
            try:
                outs.append(fn(*args))
            except Exception as e:
                errors.append(e)

        workers = [threading.Thread(target=work) for _ in range(4)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        if "donate" not in self.on:
            assert not errors, errors
        for e in errors:
            assert "deleted" in str(e) or "donated" in str(e), repr(e)
        assert outs
        return outs

    def _outer(self, n):
        """The same wrapper under an outer `jax.jit`, `jax.vmap` and `jax.grad`, on
        fresh inputs (the oracle's uncommitted: `jax.jit` moves only those)."""
        placement = (self.targets[1], self.targets[0]) if "move" in self.on else None  # pyright: ignore
        model, x = _inputs(n, placement)
        dynamic, static = eqx.partition(model, eqx.is_array)
        ref_model, ref_x = _inputs(n, None)
        ref_dynamic, self.static_model = eqx.partition(ref_model, eqx.is_array)

        def ours(dynamic, x):
            return self.ours(eqx.combine(dynamic, static), x)[0]

        for name, transform in [
            ("jit", lambda f, d, x: jax.jit(f)(d, x)),
            ("vmap", lambda f, d, x: jax.vmap(f, (None, 0))(d, jnp.stack([x, x]))),
            ("grad", lambda f, d, x: jax.grad(lambda d: jnp.sum(f(d, x)))(d)),
        ]:
            want = _outcome(lambda: transform(self.outer_oracle, ref_dynamic, ref_x))
            got = _outcome(lambda: transform(ours, dynamic, x))
            if isinstance(got, Exception) and placement is not None:
                # A tracer cannot be moved: where `jax.jit` refuses the same committed
                # inputs (vmap), so may we.
                same_model, same_x = _inputs(n, placement)
                same_dynamic = eqx.partition(same_model, eqx.is_array)[0]
                refused = _outcome(lambda: transform(self.oracle, same_dynamic, same_x))
                if isinstance(refused, Exception):
                    assert type(got) is type(refused), (name, got, refused)
                    continue
            if isinstance(want, Exception):  # JAX refuses it too (vmap of AUTO)
                assert isinstance(got, Exception), (name, got, want)
                continue
            assert not isinstance(got, Exception), (name, got)
            for a, b in zip(jtu.tree_leaves(got), jtu.tree_leaves(want)):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=name)


def _outcome(thunk):
    """`thunk()`, or the exception it raised."""
    try:
        return thunk()
    except Exception as e:
        return e


def run_cell(features) -> None:
    """Runs one cell: two sizes, one after the other, on one wrapper."""
    explain = "explain" in features
    previous = jax.config.jax_explain_cache_misses  # pyright: ignore
    jax.config.update("jax_explain_cache_misses", explain or previous)
    try:
        cell = _Cell(features)
        for n in _SIZES:
            cell.run(n)
    finally:
        jax.config.update("jax_explain_cache_misses", previous)


def _crash_prone(features) -> bool:
    return "callback" in features and bool(_CRASH_PRONE & set(features))


_PAIRS = list(it.combinations(FEATURES, 2))
_IN_PROCESS = [p for p in _PAIRS if not _crash_prone(p)]
# The triples are `slow`: each of their pairs runs in the default run.
_IN_CHILD = [p for p in _PAIRS if _crash_prone(p)] + [
    pytest.param(t, marks=pytest.mark.slow) for t in _TRIPLES
]


@pytest.mark.parametrize("features", _IN_PROCESS, ids="-x-".join)
def test_pair(features):
    run_cell(features)


_CHILD = """
import sys, warnings
sys.path.insert(0, {root!r})
from tests.test_compose import run_cell
warnings.simplefilter("error")
run_cell({features!r})
report("ok")
"""


@pytest.mark.parametrize("features", _IN_CHILD, ids="-x-".join)
def test_crash_prone_cell(features):
    run = run_isolated(_CHILD.format(root=_ROOT, features=features), timeout=300)
    assert run.returncode == 0 and run.result == "ok", run
