"""A realistic step: data-parallel training of a small transformer-like Equinox model
(a few million parameters) on every device, with Adam.

Variants, each with its own model and optimiser state, fed the same NumPy batches:

- `eqxs`: `equinox_shard.filter_jit` with `in_shardings`, `out_shardings` and
    `donate="all"`.
- `jit`: `jax.jit` with `in_shardings`/`out_shardings` on the array partition (the
    non-array part closed over) and the model and optimiser state donated.
- `eqx tutorial`: the pattern of Equinox's parallelism example: `eqx.filter_jit(
    donate="all")` with `eqx.filter_shard` inside, and an eager `eqx.filter_shard` of
    the batch before each call.

The variants take turns, one step each per round (the order rotating), on the same
batch. Reported: steps per second (from the median wall time of a step, waited for),
the median over rounds of each variant's step time over `jit`'s, and the peak
resident set size of the process during each variant's steps (the kernel's
high-water mark, reset before every step; the process's other state is included),
and the largest growth of the resident set during one step (that peak minus the
resident set just before the step).
"""

import statistics
import time

import equinox as eqx
import equinox_shard as eqxs
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax

from . import _harness as h, _trees as t
from .flat_jit import flat_step_jit


VARIANTS = ("eqxs", "jit", "eqx tutorial")


class Block(eqx.Module):
    norm1: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __init__(self, width: int, heads: int, *, key):
        k1, k2 = jr.split(key)
        self.norm1 = eqx.nn.LayerNorm(width)
        self.attention = eqx.nn.MultiheadAttention(heads, width, key=k1)
        self.norm2 = eqx.nn.LayerNorm(width)
        self.mlp = eqx.nn.MLP(
            width, width, 4 * width, 1, activation=jax.nn.gelu, key=k2
        )

    def __call__(self, x, mask):
        y = jax.vmap(self.norm1)(x)
        x = x + self.attention(y, y, y, mask=mask)
        y = jax.vmap(self.norm2)(x)
        return x + jax.vmap(self.mlp)(y)


class Transformer(eqx.Module):
    embedding: eqx.nn.Embedding
    position: jax.Array
    blocks: tuple[Block, ...]
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(
        self, vocab: int, length: int, width: int, heads: int, depth: int, *, key
    ):
        keys = jr.split(key, depth + 3)
        self.embedding = eqx.nn.Embedding(vocab, width, key=keys[0])
        self.position = 0.02 * jr.normal(keys[1], (length, width))
        self.blocks = tuple(Block(width, heads, key=k) for k in keys[3:])
        self.norm = eqx.nn.LayerNorm(width)
        self.head = eqx.nn.Linear(width, vocab, key=keys[2])

    def __call__(self, tokens):
        x = jax.vmap(self.embedding)(tokens) + self.position
        length = tokens.shape[0]
        mask = jnp.tril(jnp.ones((length, length), dtype=bool))
        for block in self.blocks:
            x = block(x, mask)
        return jax.vmap(self.head)(jax.vmap(self.norm)(x))


def _loss(model, tokens, targets):
    logits = jax.vmap(model)(tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def _n_params(model) -> int:
    return sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))


def _batches(cfg, count: int):
    rng = np.random.default_rng(0)
    shape = (cfg["batch"], cfg["length"] + 1)
    out = []
    for _ in range(count):
        data = rng.integers(0, cfg["vocab"], size=shape, dtype=np.int32)
        out.append((data[:, :-1], data[:, 1:]))
    return out


def _setup(cfg, devices: int | None = None):
    mesh = t.mesh() if devices is None else _mesh_of(devices)
    replicated = jax.NamedSharding(mesh, jax.P())
    batch = jax.NamedSharding(mesh, jax.P("data"))
    optim = optax.adam(1e-3)

    def fresh():
        model = Transformer(
            cfg["vocab"],
            cfg["length"],
            cfg["width"],
            cfg["heads"],
            cfg["depth"],
            key=jr.key(0),
        )
        opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))
        return model, opt_state

    def update(model, opt_state, tokens, targets):
        loss, grads = eqx.filter_value_and_grad(_loss)(model, tokens, targets)
        updates, opt_state = optim.update(grads, opt_state)
        model = eqx.apply_updates(model, updates)
        return model, opt_state, loss

    # 1. equinox_shard.filter_jit with shardings and donation.
    eqxs_step = eqxs.filter_jit(
        update,
        in_shardings=(replicated, replicated, batch, batch),
        out_shardings=replicated,
        donate="all",
    )
    model, opt_state = fresh()
    eqxs_state = eqxs.filter_device_put((model, opt_state), replicated)

    def eqxs_call(state, tokens, targets):
        model, opt_state = state
        model, opt_state, loss = eqxs_step(model, opt_state, tokens, targets)
        return (model, opt_state), loss

    # 2. jax.jit on the partition, the non-array part closed over.
    model, opt_state = fresh()
    params, static = eqx.partition(model, eqx.is_array)

    def on_partition(params, opt_state, tokens, targets):
        model, opt_state, loss = update(
            eqx.combine(params, static), opt_state, tokens, targets
        )
        return eqx.filter(model, eqx.is_array), opt_state, loss

    jit_step = jax.jit(
        on_partition,
        in_shardings=(replicated, replicated, batch, batch),
        out_shardings=replicated,
        donate_argnums=(0, 1),
    )
    jit_state = jax.device_put((params, opt_state), replicated)

    def jit_call(state, tokens, targets):
        params, opt_state, loss = jit_step(*state, tokens, targets)
        return (params, opt_state), loss

    # 3. Equinox's tutorial pattern.
    @eqx.filter_jit(donate="all")
    def tutorial_step(model, opt_state, tokens, targets):
        model, opt_state = eqx.filter_shard((model, opt_state), replicated)
        tokens, targets = eqx.filter_shard((tokens, targets), batch)
        model, opt_state, loss = update(model, opt_state, tokens, targets)
        model, opt_state = eqx.filter_shard((model, opt_state), replicated)
        return model, opt_state, loss

    model, opt_state = fresh()
    tutorial_state = eqx.filter_shard((model, opt_state), replicated)

    def tutorial_call(state, tokens, targets):
        tokens, targets = eqx.filter_shard((tokens, targets), batch)
        model, opt_state = state
        model, opt_state, loss = tutorial_step(model, opt_state, tokens, targets)
        return (model, opt_state), loss

    # 4. The flat sketch (benchmarks/flat_jit.py), with the same shardings and donation.
    flat_step = flat_step_jit(
        update, (replicated, replicated, batch, batch), replicated, donated=2
    )
    model, opt_state = fresh()
    flat_state = eqxs.filter_device_put((model, opt_state), replicated)

    def flat_call(state, tokens, targets):
        model, opt_state, loss = flat_step(*state, tokens, targets)
        return (model, opt_state), loss

    n_params = _n_params(model)
    calls = {
        "eqxs": eqxs_call,
        "jit": jit_call,
        "eqx tutorial": tutorial_call,
        "flat sketch": flat_call,
    }
    states = {
        "eqxs": eqxs_state,
        "jit": jit_state,
        "eqx tutorial": tutorial_state,
        "flat sketch": flat_state,
    }
    return calls, states, n_params


def run(cfg: dict) -> dict:
    cfg = {**cfg, **cfg["step"]}
    calls, states, n_params = _setup(cfg)
    batches = _batches(cfg, 4)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    peaks: dict[str, float] = {v: 0.0 for v in VARIANTS}
    growth: dict[str, float] = {v: 0.0 for v in VARIANTS}
    losses: dict[str, float] = {}
    resettable = True
    # One step of each variant per round (A B C, B C A, ...), on the same batch.
    for r in range(cfg["warmup"] + cfg["reps"]):
        tokens, targets = batches[r % len(batches)]
        shift = r % len(VARIANTS)
        for v in VARIANTS[shift:] + VARIANTS[:shift]:
            resettable = h.reset_peak_rss() and resettable
            before = h.rss_mib()
            start = time.perf_counter()
            states[v], loss = calls[v](states[v], tokens, targets)
            jax.block_until_ready((states[v], loss))
            stop = time.perf_counter()
            if r >= cfg["warmup"]:
                times[v].append(stop - start)
                peak = h.peak_rss_mib()
                peaks[v] = max(peaks[v], peak)
                growth[v] = max(growth[v], peak - before)
            losses[v] = float(loss)
    seconds = {v: statistics.median(times[v]) for v in VARIANTS}
    ratio = h.paired_ratios(times, list(VARIANTS), "jit")
    return {
        "variants": list(VARIANTS),
        "model": {
            k: cfg[k] for k in ("vocab", "length", "width", "heads", "depth", "batch")
        },
        "n_params": n_params,
        "devices": jax.device_count(),
        "seconds_per_step": seconds,
        "seconds_every_step": times,
        "steps_per_second": {v: 1 / s for v, s in seconds.items()},
        "ratio_to_jit": ratio,
        "peak_rss_mib": peaks,
        "peak_rss_step_growth_mib": growth,
        "peak_rss_is_per_variant": resettable,
        "final_loss": losses,
        "feeds": run_feeds(cfg),
    }


def render(result: dict) -> str:
    m = result["model"]
    headers = [
        "variant",
        "ms/step",
        "steps/s",
        "time / jit",
        "peak RSS MiB",
        "peak - RSS before step, MiB",
    ]
    rows = [
        [
            v,
            f"{result['seconds_per_step'][v] * 1e3:.1f}",
            f"{result['steps_per_second'][v]:.2f}",
            h.fmt(result["ratio_to_jit"][v], "x"),
            f"{result['peak_rss_mib'][v]:.0f}",
            f"{result['peak_rss_step_growth_mib'][v]:.0f}",
        ]
        for v in VARIANTS
    ]
    title = (
        f"### Training step: transformer, {result['n_params'] / 1e6:.2f}M parameters "
        f"(width {m['width']}, depth {m['depth']}, {m['heads']} heads, vocab "
        f"{m['vocab']}), batch {m['batch']}x{m['length']} tokens, data-parallel on "
        f"{result['devices']} devices"
    )
    text = title + "\n\n" + h.table(headers, rows)
    if "feeds" in result:
        text += "\n\n" + render_feeds(result["feeds"])
    return text


#
# Fed as users feed it (issue 48): a fresh batch every step, as NumPy arrays or as
# `jnp.asarray` of them (uncommitted), which `jax.jit` moves onto `in_shardings` itself;
# on every device and on one (a one-device mesh, the same program). The flat sketch with
# the same shardings and donation is the least a filtered jit does on this path.
#

FEEDS = ("numpy", "jnp.asarray")
FEED_VARIANTS = ("eqxs", "jit", "flat sketch")
TARGET_FEEDS = 1.05  # eqxs / jit, every layout and feed


def _mesh_of(devices: int):
    return jax.make_mesh(
        (devices,),
        ("data",),
        axis_types=(jax.sharding.AxisType.Auto,),
        devices=jax.devices()[:devices],
    )


def run_feeds(cfg: dict) -> dict:
    """`cfg` as `run`'s, its `step` entries merged."""
    rng = np.random.default_rng(1)
    shape = (cfg["batch"], cfg["length"] + 1)
    rows = []
    for devices in sorted({jax.device_count(), 1}, reverse=True):
        calls, states, _ = _setup(cfg, devices)
        for feed in FEEDS:
            times: dict[str, list[float]] = {v: [] for v in FEED_VARIANTS}
            for r in range(cfg["warmup"] + cfg["reps"]):
                shift = r % len(FEED_VARIANTS)
                for v in FEED_VARIANTS[shift:] + FEED_VARIANTS[:shift]:
                    data = rng.integers(0, cfg["vocab"], size=shape, dtype=np.int32)
                    start = time.perf_counter()
                    tokens, targets = data[:, :-1], data[:, 1:]
                    if feed == "jnp.asarray":
                        tokens, targets = jnp.asarray(tokens), jnp.asarray(targets)
                    states[v], loss = calls[v](states[v], tokens, targets)
                    jax.block_until_ready((states[v], loss))
                    stop = time.perf_counter()
                    if r >= cfg["warmup"]:
                        times[v].append(stop - start)
            ratio = h.paired_ratios(times, list(FEED_VARIANTS), "jit")
            rows.append(
                {
                    "devices": devices,
                    "feed": feed,
                    "seconds_per_step": {
                        v: statistics.median(times[v]) for v in FEED_VARIANTS
                    },
                    "eqxs_over_jit": ratio["eqxs"],
                    "flat_over_jit": ratio["flat sketch"],
                }
            )
    return {"rows": rows}


def render_feeds(result: dict) -> str:
    headers = [
        "devices",
        "batch fed as",
        "eqxs ms/step",
        "jit ms/step",
        "flat sketch ms/step",
        "eqxs / jit",
        "flat sketch / jit",
    ]
    rows = [
        [
            r["devices"],
            r["feed"],
            f"{r['seconds_per_step']['eqxs'] * 1e3:.2f}",
            f"{r['seconds_per_step']['jit'] * 1e3:.2f}",
            f"{r['seconds_per_step']['flat sketch'] * 1e3:.2f}",
            h.fmt(r["eqxs_over_jit"], "x")
            + (" pass" if r["eqxs_over_jit"] <= TARGET_FEEDS else " FAIL"),
            h.fmt(r["flat_over_jit"], "x"),
        ]
        for r in result["rows"]
    ]
    title = (
        "### Training step fed a fresh batch every step (issue 48; target eqxs/jit "
        f"<= {TARGET_FEEDS}x)"
    )
    return title + "\n\n" + h.table(headers, rows)


if __name__ == "__main__":
    from .run import FULL, QUICK

    options = h.standalone_options("issue 48's fed training step")
    config = QUICK if options.quick else FULL
    print(render_feeds(run_feeds({**config, **config["step"]})))
