"""A body with a host callback, through `equinox_shard.filter_jit` and through
`equinox.filter_jit` (no shardings, 8 devices visible): the step of a small
`eqx.nn.MLP` on a batch, its output passed through one callback of each kind.

Kinds:

- `error_if`: `eqx.error_if` (a `jax.pure_callback` that raises; every diffrax,
    optimistix and lineax solve has one);
- `debug.callback`: `jax.debug.callback` (an effect: a callback with no output);
- `pure_callback`: `jax.pure_callback` returning a value;
- `none`: no callback, for reference.

Wall µs per call, each call waited for (`equinox_shard.filter_jit` waits for a
function with a callback, to raise what the callback raised).

Target per cell (issue 41): eqxs/eqx <= 1.1x.
"""

import equinox as eqx
import equinox_shard as eqxs
import jax
import jax.numpy as jnp
import numpy as np

from . import _harness as h


KINDS = ("error_if", "debug.callback", "pure_callback", "none")
VARIANTS = ("eqx", "eqxs")
TARGET = 1.1  # eqxs/eqx, every kind


def _body(kind: str):
    def step(model, x):
        y = jax.vmap(model)(x)
        if kind == "error_if":
            y = eqx.error_if(y, jnp.isnan(y).any(), "NaN in the output")
        elif kind == "debug.callback":
            jax.debug.callback(lambda total: None, y.sum())
        elif kind == "pure_callback":
            shape = jax.ShapeDtypeStruct((), y.dtype)
            y = y + jax.pure_callback(
                lambda total: np.zeros((), total.dtype), shape, y.sum()
            )
        return y

    return step


def run(cfg: dict) -> dict:
    model = eqx.nn.MLP(16, 16, 64, 2, key=jax.random.key(0))
    x = jnp.ones((32, 16))
    cells = {}
    for kind in KINDS:
        samplers = {}
        for name, jit in (("eqx", eqx.filter_jit), ("eqxs", eqxs.filter_jit)):
            fn = jit(_body(kind))
            for _ in range(3):  # compile, then reach JAX's C++ fast path
                jax.block_until_ready(fn(model, x))
            inner = h.calibrate(fn, (model, x), cfg["sample_s"], cfg["max_inner"])
            samplers[name] = lambda fn=fn, inner=inner: h.sample_sync(
                fn, (model, x), inner
            )
        cells[kind] = samplers
    rounds = cfg["warmup"] + cfg["reps"]
    measured = h.interleaved(
        cells,
        reps=cfg["reps"],
        warmup=cfg["warmup"],
        progress=h.progress_printer("callbacks", rounds, cfg["verbose"]),
    )
    rows = []
    for kind, (medians, samples) in measured.items():
        rows.append(
            {
                "kind": kind,
                "seconds": dict(medians),
                "eqxs_over_eqx": h.paired_ratios(samples, ["eqxs"], "eqx")["eqxs"],
            }
        )
    return {"variants": list(VARIANTS), "rows": rows}


def render(result: dict) -> str:
    headers = ["callback", "eqx", "eqxs", "eqxs/eqx (target)"]
    rows = []
    met = 0
    for r in result["rows"]:
        ratio = r["eqxs_over_eqx"]
        ok = ratio is not None and ratio <= TARGET
        met += ok
        rows.append(
            [
                r["kind"],
                h.fmt(r["seconds"]["eqx"]),
                h.fmt(r["seconds"]["eqxs"]),
                f"{h.fmt(ratio, 'x')} (<= {TARGET}x) " + ("pass" if ok else "FAIL"),
            ]
        )
    return (
        "### Callbacks: wall µs per call, each waited for (MLP step, no shardings)\n\n"
        f"Target per kind (issue 41): eqxs/eqx <= {TARGET}x "
        f"({met}/{len(rows)} pass).\n\n" + h.table(headers, rows)
    )
