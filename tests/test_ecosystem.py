"""Equinox-ecosystem code (diffrax, optimistix, lineax) through `eqxs.filter_jit`,
compared with `eqx.filter_jit`.

Every solve of these libraries calls `eqx.error_if`, so each body holds callbacks: the
cases run on *one* wrapper, one call after another, at two shapes and two dtypes (x64 is
off in the suite: float32 and float16 where the library takes it, else a second dtype in
the arguments), as a user's code meets them.
"""

import diffrax
import equinox as eqx
import equinox_shard as eqxs
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import lineax as lx
import numpy as np
import optimistix as optx
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from .helpers import tree_allclose
from .strategies import cached_mesh


def _placements():
    return {"unsharded": {}, "replicated": {"in_shardings": _replicated()}}


def _replicated():
    return NamedSharding(cached_mesh("1d", AxisType.Auto), P())


def _host(shape, dtype, seed=0):
    return jnp.asarray(np.random.default_rng(seed).uniform(0.5, 1.5, shape), dtype)


def _ode_solve(y0, rate):
    term = diffrax.ODETerm(lambda t, y, args: -args * y)
    solution = diffrax.diffeqsolve(
        term,
        diffrax.Tsit5(),
        t0=0.0,
        t1=1.0,
        dt0=0.1,
        y0=y0,
        args=rate,
        stepsize_controller=diffrax.PIDController(rtol=1e-3, atol=1e-6),
        saveat=diffrax.SaveAt(t1=True),
    )
    return solution.ys, solution.stats["num_steps"]


def _root_find(y0, target):
    def fn(y, target):
        return jnp.tanh(y) - target.astype(y.dtype)

    solver = optx.Newton(rtol=1e-5, atol=1e-5)
    return optx.root_find(fn, solver, y0, args=target).value


def _linear_solve(matrix, vector):
    # CG's result is known only at run time: the check is a callback in the program.
    operator = lx.MatrixLinearOperator(matrix, lx.positive_semidefinite_tag)
    solver = lx.CG(rtol=1e-5, atol=1e-5, max_steps=100)
    solution = lx.linear_solve(operator, vector, solver, throw=False)
    failed = solution.result != lx.RESULTS.successful
    return eqx.error_if(solution.value, failed, "linear solve failed")


def _sequence(first, second, other_dtype):
    # One wrapper meets a new dtype, then a new shape: each retraces.
    return [(first, jnp.float32), (first, other_dtype), (second, other_dtype)]


def _ode_cases():
    # diffrax takes float16 states (it solves in the time's float32).
    for shape, dtype in _sequence((3,), (2, 5), jnp.float16):
        yield _host(shape, dtype), jnp.asarray(1.5, jnp.float32)


def _root_cases():
    # optimistix solves float32 only (x64 off): the second dtype is the arguments'.
    for shape, dtype in _sequence((3,), (4, 2), jnp.float16):
        yield jnp.zeros(shape, jnp.float32), _host(shape, dtype) * 0.5


def _linear_cases():
    # lineax solves float32 and complex64 (here: symmetric positive definite).
    for n, dtype in _sequence(3, 6, jnp.complex64):
        half = _host((n, n), jnp.float32, seed=1)
        matrix = half @ half.T + n * jnp.eye(n)
        yield matrix.astype(dtype), _host((n,), jnp.float32).astype(dtype)


_CASES = {
    "diffrax": (_ode_solve, _ode_cases),
    "optimistix": (_root_find, _root_cases),
    "lineax": (_linear_solve, _linear_cases),
}


# Without shardings (the path every other test takes too) is `slow`.
@pytest.mark.parametrize(
    "placement", [pytest.param("unsharded", marks=pytest.mark.slow), "replicated"]
)
@pytest.mark.parametrize("library", list(_CASES))
def test_solves_in_sequence_on_one_wrapper(library, placement):
    fn, cases = _CASES[library]
    ours = eqxs.filter_jit(fn, **_placements()[placement])
    reference = eqx.filter_jit(fn)
    for args in cases():
        expected = reference(*args)
        out = ours(*args)
        assert jtu.tree_structure(out) == jtu.tree_structure(expected)
        assert tree_allclose(out, expected, rtol=1e-6, atol=1e-6), (args, out, expected)


#
# A neural ODE trained in two stages of growing sequence length (diffrax's example).
#


class _Func(eqx.Module):
    mlp: eqx.nn.MLP

    def __call__(self, t, y, args):
        return self.mlp(y)


class _NeuralODE(eqx.Module):
    func: _Func

    def __init__(self, key):
        self.func = _Func(eqx.nn.MLP(2, 2, 8, depth=1, activation=jnp.tanh, key=key))

    def __call__(self, ts, y0):
        solution = diffrax.diffeqsolve(
            diffrax.ODETerm(self.func),
            diffrax.Tsit5(),
            t0=ts[0],
            t1=ts[-1],
            dt0=ts[1] - ts[0],
            y0=y0,
            stepsize_controller=diffrax.PIDController(rtol=1e-3, atol=1e-6),
            saveat=diffrax.SaveAt(ts=ts),
        )
        return solution.ys


def _train(jit, **kwargs):
    """Two stages of three SGD steps, the second on twice the sequence length; returns
    the losses and the trained model."""

    @jit(**kwargs)
    def step(model, ts, ys):
        def loss_fn(model):
            predicted = jax.vmap(model, in_axes=(None, 0))(ts, ys[:, 0])
            return jnp.mean((ys - predicted) ** 2)

        loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
        model = eqx.apply_updates(model, jtu.tree_map(lambda g: -0.1 * g, grads))
        return loss, model

    model = _NeuralODE(jax.random.key(0))
    rng = np.random.default_rng(0)
    losses = []
    for length in [5, 10]:
        ts = jnp.linspace(0.0, 1.0, length)
        y0 = jnp.asarray(rng.uniform(-0.6, 1.0, (4, 2)), jnp.float32)
        ys = y0[:, None, :] * jnp.exp(-ts)[None, :, None]
        for _ in range(3):
            loss, model = step(model, ts, ys)
            losses.append(loss)
    return losses, model


@pytest.mark.parametrize(
    "placement",
    [pytest.param(p, marks=pytest.mark.slow) for p in ("unsharded", "replicated")],
)
def test_neural_ode_in_stages_of_growing_length(placement):
    try:
        expected_losses, expected_model = _train(eqx.filter_jit)
    except AttributeError as e:
        if "mapped_aval" not in str(e):
            raise
        # Equinox before its `jax.extend.core.mapped_aval` fallback, on JAX >= 0.10:
        # the reference itself cannot run (the oldest pins, Equinox 0.13.1).
        pytest.skip(f"eqx.filter_jit fails here too: {e}")
    losses, model = _train(eqxs.filter_jit, **_placements()[placement])
    assert tree_allclose(losses, expected_losses, rtol=1e-5, atol=1e-7)
    assert tree_allclose(model, expected_model, rtol=1e-5, atol=1e-7)
