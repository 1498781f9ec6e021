"""The run for an accelerator: `python -m benchmarks --device` (a few minutes), or
`python -m benchmarks --device --quick` (the same table with sizes scaled down, in
under a minute on a CPU: its numbers mean nothing).

It runs on JAX's default backend and every device it has (on a CPU, 8 simulated
devices), and prints one table, each row `equinox_shard` against its peer:

- **host-to-device**: a PyTree of NumPy arrays (1 GiB; 4 MiB in the quick run), split
    over the devices: `eqxs.filter_device_put` against `jax.device_put` of its array
    leaves, in GB/s.
- **dispatch**: `eqxs.filter_jit` of an already-compiled trivial body, N = 1, 10 and
    100 array leaves of a Module tree (`benchmarks/dispatch.py`, asynchronous dispatch,
    replicated, wall clock with one wait at the end): against `jax.jit` on the flat
    leaves (without and with shardings), the flat sketch (`benchmarks/flat_jit.py`)
    and `eqx.filter_jit`, in µs per call.
- **training step**: the transformer of `examples/train_transformer.py` (its
    `train_step`, data-parallel, donating) against `jax.jit` of the same body on the
    partitioned leaves with the same shardings and donation, in ms per step; and the
    peak device memory of each (`Device.memory_stats()`; `jax.jit` steps first, so an
    `eqxs` peak above it is memory that `eqxs` needs and `jax.jit` does not).
- **restore** and **background save** (`benchmarks/checkpoint.py`): the restore's
    throughput against orbax used directly; the cost of a background save to 10
    training steps against orbax's own background save.
- **host offload**: a round trip of a PyTree to host memory and back
    (`jax.memory.Space.Host`, `Space.Device`): `eqxs.filter_device_put` against
    `jax.device_put`, in GB/s (bytes moved, both ways).

A row whose feature the backend lacks says "n/a (backend has no ...)"; the rows of a
section that raised say "failed: ..." (the run goes on, and exits with status 1).
"""

import collections
import sys
import time
import traceback

import equinox as eqx
import equinox_shard as eqxs
import jax
import jax.tree_util as jtu
import numpy as np

from . import _harness as h, _trees as t


FULL = {
    "transfer_bytes": 2**30,
    "reps": 7,
    "warmup": 1,
    # Samples of 20 ms: the TPU host's wall clock varied 10-20% between runs at 3 ms.
    "dispatch": {"reps": 21, "warmup": 2, "sample_s": 0.02, "max_inner": 1000},
    "example": {
        "width": 512,
        "heads": 8,
        "depth": 4,
        "hidden": 2048,
        "length": 256,
        "batch": 64,
    },
    "step_reps": 20,
    "checkpoint": {
        "step": {
            "vocab": 1024,
            "length": 128,
            "width": 512,
            "heads": 8,
            "depth": 4,
            "batch": 32,
        },
        "checkpoint": {"reps": 5, "warmup": 1},
    },
}

QUICK = {
    "transfer_bytes": 4 * 2**20,
    "reps": 2,
    "warmup": 1,
    "dispatch": {"reps": 2, "warmup": 1, "sample_s": 0.0002, "max_inner": 5},
    "example": {
        "width": 16,
        "heads": 2,
        "depth": 1,
        "hidden": 32,
        "length": 8,
        "batch": 8,
    },
    "step_reps": 2,
    "checkpoint": {
        "step": {
            "vocab": 16,
            "length": 8,
            "width": 16,
            "heads": 2,
            "depth": 1,
            "batch": 8,
        },
        "checkpoint": {"reps": 1, "warmup": 1},
    },
}

DISPATCH_NS = (1, 10, 100)
# Per N, the peers of `eqxs.filter_jit` in the dispatch rows: (row name, eqxs variant,
# peer variant of `benchmarks/dispatch.py`, peer name).
DISPATCH_PEERS = (
    ("vs jax.jit", "eqxs", "floor", "jax.jit on the flat leaves"),
    ("with shardings vs jax.jit", "eqxs+shard", "jit+shard", "jax.jit, shardings"),
    ("vs flat sketch", "eqxs", "flat", "flat sketch"),
    ("vs eqx.filter_jit", "eqxs", "eqx", "eqx.filter_jit"),
)


def _dispatch_ratio(row: dict, peer: str) -> float | None:
    """eqxs over `peer` in a row of `benchmarks/dispatch.py`: medians of paired
    ratios."""
    if peer == "floor":
        return row["ratio_to_floor"]["eqxs"]
    if peer == "jit+shard":
        return row["eqxs_shard_over_jit_shard"]
    if peer == "flat":
        return row["ratio_to_flat"]["eqxs"]
    return None if not row["eqx_over_eqxs"] else 1 / row["eqx_over_eqxs"]


# The rows of each section, in order (the quick run's test checks each is printed).
SECTION_ROWS = {
    "host-to-device": ("host-to-device",),
    "dispatch": tuple(
        f"dispatch N={n} {what}" for n in DISPATCH_NS for what, *_ in DISPATCH_PEERS
    ),
    "training step": ("training step", "training step peak memory"),
    "checkpoint": ("restore", "background save"),
    "host offload": ("host offload round trip",),
}
ROWS = sum(SECTION_ROWS.values(), ())


def _row(what, ours, peer_name, peer, unit, ratio=None, note=""):
    return {
        "row": what,
        "eqxs": ours,
        "peer": peer_name,
        "peer_value": peer,
        "unit": unit,
        "ratio": ratio,
        "note": note,
    }


def _na(what, missing):
    return {"row": what, "na": f"n/a (backend has no {missing})"}


def _device_tree(total_bytes: int) -> dict:
    """`total_bytes` of float32 NumPy arrays in 8 leaves (and a non-array leaf), each
    with a leading axis that every device count up to 64 divides."""
    n = max(1, jax.device_count())
    cols = 1024
    rows = max(n, total_bytes // 8 // 4 // cols // n * n)
    rng = np.random.default_rng(0)
    leaves = [rng.standard_normal((rows, cols), dtype=np.float32) for _ in range(8)]
    return {"arrays": leaves, "name": "a non-array leaf"}


def _size(nbytes: int) -> str:
    return (
        f"{nbytes / 2**20:.0f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.0f} KiB"
    )


def _count(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 100_000 else f"{n:,}"


def _nbytes(tree) -> int:
    return sum(x.nbytes for x in jtu.tree_leaves(tree) if eqx.is_array(x))


def _timed(fn):
    """A sampler: the wall seconds of one call of `fn`, waited for; the result is
    dropped at once (a GiB on the device)."""

    def sample():
        start = time.perf_counter()
        out = jax.block_until_ready(fn())
        stop = time.perf_counter()
        del out
        return stop - start

    return sample


def _transfer(cfg) -> list[dict]:
    tree = _device_tree(cfg["transfer_bytes"])
    s = t.sharding("batch")
    leaves = tree["arrays"]
    nbytes = _nbytes(tree)
    cells = {
        "transfer": {
            "eqxs": _timed(lambda: eqxs.filter_device_put(tree, s)),
            "jax": _timed(lambda: jax.device_put(leaves, s)),
        }
    }
    (medians, samples), *_ = h.interleaved(
        cells, reps=cfg["reps"], warmup=cfg["warmup"], progress=lambda r: None
    ).values()
    ratio = h.paired_ratios(samples, ["eqxs"], "jax")["eqxs"]
    gbs = lambda v: nbytes / medians[v] / 1e9
    return [
        _row(
            "host-to-device",
            gbs("eqxs"),
            "jax.device_put",
            gbs("jax"),
            "GB/s",
            ratio,
            f"{_size(nbytes)}, NumPy, split over {jax.device_count()} "
            "devices; ratio of times",
        )
    ]


def _offload(cfg) -> list[dict]:
    kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
    if "pinned_host" not in kinds:
        return [_na("host offload round trip", "host memory space")]
    host, device = jax.memory.Space.Host, jax.memory.Space.Device
    tree = t.place(_device_tree(cfg["transfer_bytes"]), t.sharding("batch"))
    leaves = tree["arrays"]
    nbytes = _nbytes(tree)

    def ours():
        return eqxs.filter_device_put(eqxs.filter_device_put(tree, host), device)

    def peer():
        return jax.device_put(jax.device_put(leaves, host), device)

    back = ours()
    assert all(x.sharding.memory_kind == "device" for x in back["arrays"])
    assert back["name"] is tree["name"]
    del back
    cells = {"offload": {"eqxs": _timed(ours), "jax": _timed(peer)}}
    (medians, samples), *_ = h.interleaved(
        cells, reps=cfg["reps"], warmup=cfg["warmup"], progress=lambda r: None
    ).values()
    ratio = h.paired_ratios(samples, ["eqxs"], "jax")["eqxs"]
    gbs = lambda v: 2 * nbytes / medians[v] / 1e9
    return [
        _row(
            "host offload round trip",
            gbs("eqxs"),
            "jax.device_put",
            gbs("jax"),
            "GB/s",
            ratio,
            f"{_size(nbytes)} to pinned_host and back; ratio of times",
        )
    ]


def _dispatch(cfg) -> list[dict]:
    from . import dispatch

    sub = {
        **cfg["dispatch"],
        "layouts": ["replicated"],
        "ns": list(DISPATCH_NS),
        "verbose": False,
        # A TPU host's thread CPU clock read 0 for whole samples.
        "async_clock": "wall",
    }
    result = dispatch.run(sub)
    out = []
    for n in DISPATCH_NS:
        (row,) = [
            r
            for r in result["rows"]
            if r["tree"] == "module" and r["n"] == n and r["mode"] == "async"
        ]
        for what, ours, peer, peer_name in DISPATCH_PEERS:
            out.append(
                _row(
                    f"dispatch N={n} {what}",
                    row["seconds"][ours] * 1e6,
                    peer_name,
                    row["seconds"][peer] * 1e6,
                    "µs/call",
                    _dispatch_ratio(row, peer),
                    "wall clock, asynchronous dispatch, one wait at the end"
                    if what == "vs jax.jit"
                    else "",
                )
            )
    return out


def _peak_bytes() -> int | None:
    peaks = []
    for d in jax.local_devices():
        stats = d.memory_stats()
        if not stats or "peak_bytes_in_use" not in stats:
            return None
        peaks.append(stats["peak_bytes_in_use"])
    return max(peaks)


def _step(cfg) -> list[dict]:
    ex = h.transformer_example()
    config = ex.Config(**cfg["example"])
    layout = ex.make_layout("data", jax.devices())
    _, init_sharded, train_step = ex.make_functions(
        layout, config, collections.Counter()
    )
    batch_sharding = jax.NamedSharding(layout.mesh, layout.batch)
    rng = np.random.default_rng(0)
    shape = (config.batch, config.length + 1)
    batches = []
    for _ in range(4):
        data = rng.integers(0, config.vocab, size=shape, dtype=np.int32)
        batches.append(jax.device_put((data[:, :-1], data[:, 1:]), batch_sharding))
    with jax.set_mesh(layout.mesh):
        ours = list(init_sharded(jax.random.key(0)))
        arrays, static = eqx.partition(init_sharded(jax.random.key(0)), eqx.is_array)
    shardings = jtu.tree_map(lambda x: x.sharding, arrays)
    body = train_step.__wrapped__

    def on_partition(arrays, tokens, targets):
        model, opt_state = eqx.combine(arrays, static)
        model, opt_state, loss = body(model, opt_state, tokens, targets)
        return eqx.filter((model, opt_state), eqx.is_array), loss

    jitted = jax.jit(
        on_partition,
        in_shardings=(shardings, batch_sharding, batch_sharding),
        out_shardings=(shardings, jax.NamedSharding(layout.mesh, jax.P())),
        donate_argnums=0,
    )
    theirs = [arrays]
    counter = collections.Counter()

    def eqxs_step():
        tokens, targets = batches[counter["eqxs"] % len(batches)]
        counter["eqxs"] += 1
        ours[0], ours[1], loss = train_step(ours[0], ours[1], tokens, targets)
        return ours, loss

    def jit_step():
        tokens, targets = batches[counter["jit"] % len(batches)]
        counter["jit"] += 1
        theirs[0], loss = jitted(theirs[0], tokens, targets)
        return theirs, loss

    with jax.set_mesh(layout.mesh):
        # Compiled, then the peak of each: `jax.jit`'s steps first.
        jax.block_until_ready(jit_step())
        base = _peak_bytes()
        for _ in range(3):
            jax.block_until_ready(jit_step())
        peak_jit = _peak_bytes()
        for _ in range(4):
            jax.block_until_ready(eqxs_step())
        peak_eqxs = _peak_bytes()
        measured = h.interleaved(
            {"step": {"eqxs": _timed(eqxs_step), "jit": _timed(jit_step)}},
            reps=cfg["step_reps"],
            warmup=cfg["warmup"],
            progress=lambda r: None,
        )
    (medians, samples), *_ = measured.values()
    n_params = sum(
        x.size for x in jtu.tree_leaves(eqx.filter(ours[0], eqx.is_inexact_array))
    )
    rows = [
        _row(
            "training step",
            medians["eqxs"] * 1e3,
            "jax.jit",
            medians["jit"] * 1e3,
            "ms/step",
            h.paired_ratios(samples, ["eqxs"], "jit")["eqxs"],
            f"examples/train_transformer.py, {_count(n_params)} parameters, "
            f"batch {config.batch}x{config.length}, data-parallel on "
            f"{jax.device_count()} devices",
        )
    ]
    if base is None or peak_jit is None or peak_eqxs is None:
        rows.append(_na("training step peak memory", "memory_stats"))
    else:
        gib = 2**30
        rows.append(
            _row(
                "training step peak memory",
                peak_eqxs / gib,
                "jax.jit",
                peak_jit / gib,
                "GiB peak",
                peak_eqxs / peak_jit,
                "peak_bytes_in_use of the fullest device; jax.jit's steps first",
            )
        )
    return rows


def _checkpoint(cfg) -> list[dict]:
    try:
        import orbax.checkpoint  # noqa: F401
    except ImportError:
        return [_na(r, "orbax-checkpoint installed") for r in ROWS[7:9]]
    from . import checkpoint

    result = checkpoint.run({**cfg["checkpoint"], "verbose": False})
    nbytes = result["state_bytes"]
    restore = result["restore_seconds"]
    ratio = result["steps_ratio_to_none"]
    return [
        _row(
            "restore",
            nbytes / restore["eqxs"] / 1e9,
            "orbax",
            nbytes / restore["orbax"] / 1e9,
            "GB/s",
            result["restore_ratio_to_orbax"]["eqxs"],
            f"{_count(result['n_params'])} parameters and Adam state, "
            f"{_size(nbytes)}, sharded; ratio of times",
        ),
        _row(
            "background save",
            ratio["background"],
            "orbax background",
            ratio["orbax-background"],
            "x 10 steps",
            ratio["background"] / ratio["orbax-background"],
            "10 donating training steps after a save, over 10 without; "
            "CheckpointManager.save against orbax's asynchronous save",
        ),
    ]


def run(cfg: dict) -> dict:
    sections = {
        "host-to-device": _transfer,
        "dispatch": _dispatch,
        "training step": _step,
        "checkpoint": _checkpoint,
        "host offload": _offload,
    }
    rows, seconds, failed = [], {}, []
    for name, section in sections.items():
        if cfg.get("only") is not None and name not in cfg["only"]:
            rows += [{"row": r, "na": "not run (--only)"} for r in SECTION_ROWS[name]]
            continue
        if cfg["verbose"]:
            print(f"running {name} ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        try:
            rows += section(cfg)
        except Exception as e:
            # One section's failure costs its rows, not the whole table (a run on a
            # borrowed chip is long and rare).
            traceback.print_exc()
            failed.append(name)
            message = f"failed: {type(e).__name__}: {e}".splitlines()[0][:120]
            rows += [{"row": r, "na": message} for r in SECTION_ROWS[name]]
        seconds[name] = time.perf_counter() - start
    assert [r["row"] for r in rows] == list(ROWS), [r["row"] for r in rows]
    return {"rows": rows, "seconds": seconds, "failed": failed}


def _value(x, unit: str) -> str:
    if x is None:
        return "-"
    if unit == "µs/call":
        return f"{x:.1f}"
    return f"{x:.3g}" if x < 100 else f"{x:.0f}"


def render(result: dict) -> str:
    headers = ["measurement", "eqxs", "peer", "peer value", "unit", "eqxs/peer", ""]
    rows = []
    for r in result["rows"]:
        if "na" in r:
            rows.append([r["row"], r["na"], "", "", "", "", ""])
            continue
        rows.append(
            [
                r["row"],
                _value(r["eqxs"], r["unit"]),
                r["peer"],
                _value(r["peer_value"], r["unit"]),
                r["unit"],
                h.fmt(r["ratio"], "x"),
                r["note"],
            ]
        )
    times = ", ".join(f"{k} {v:.0f} s" for k, v in result["seconds"].items())
    return (
        "### On an accelerator: equinox_shard against its peer\n\n"
        f"Seconds per section: {times}.\n\n" + h.table(headers, rows)
    )
