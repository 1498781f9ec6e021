"""Host dispatch of an already-compiled function whose body is trivial (add one to every
array leaf), so that the time is the Python and C++ work around the computation.

Variants, all called on the same placed (committed) inputs:

- `floor`: `jax.jit` on the array partition, made once up front (the non-array part
    closed over): what a hand-written program pays at the least.
- `jit+shard`: the same, with `in_shardings`/`out_shardings`.
- `flat` (`flat sketch` in the tables): the ~35-line flat-leaf filtered jit of
    `benchmarks/flat_jit.py`, what a careful user would write by hand: the peer.
- `flat+lock` (`flat sketch+lock`): the flat sketch launching under a lock wherever
    `equinox_shard.filter_jit` does (a multi-device sharding on the CPU): the peer at
    equal thread safety.
- `eqx`: `equinox.filter_jit`.
- `eqxs`: `equinox_shard.filter_jit` without shardings.
- `eqxs+shard`: `equinox_shard.filter_jit` with `in_shardings`/`out_shardings`.

Modes: `async` is the calling thread's CPU time per call (`time.thread_time`) with
asynchronous dispatch (wall time instead with `cfg["async_clock"] = "wall"`, as the
accelerator run does: a TPU host's thread CPU clock is coarser than a sample); `sync`
is wall time per call, each call waited for.

Targets (issue 23), per cell of asynchronous dispatch, every N and layout: `eqxs` at
most 1.1x the flat sketch, and at most 1.15x the floor at N >= 10 (1.3x at N = 1).
The same 1.1x against `flat+lock` is reported beside it: on the CPU a multi-device call
of ours pays for a lock that the flat sketch, which is not thread-safe, does not.
"""

import threading

import equinox as eqx
import equinox_shard as eqxs
import jax
import numpy as np
from equinox_shard._jit.launch import serialize_dispatch

from . import _harness as h, _trees as t
from .flat_jit import flat_jit


VARIANTS = ("floor", "jit+shard", "flat", "flat+lock", "eqx", "eqxs", "eqxs+shard")
MODES = ("async", "sync")
# How a variant is named in the tables.
NAMES = {"flat": "flat sketch", "flat+lock": "flat sketch+lock"}

TARGET_FLAT = 1.1  # eqxs/flat, asynchronous dispatch, every cell
TARGET_FLOOR = 1.15  # eqxs/floor, asynchronous dispatch, N >= 10
TARGET_FLOOR_N1 = 1.3  # eqxs/floor, asynchronous dispatch, N = 1


def floor_target(n: int) -> float:
    return TARGET_FLOOR_N1 if n == 1 else TARGET_FLOOR


def _variants(tree, s):
    dynamic, static = eqx.partition(tree, eqx.is_array)
    # The lock wherever `filter_jit` takes it.
    serialized = serialize_dispatch([s])

    def on_partition(dynamic):
        return eqx.partition(t.add_one(eqx.combine(dynamic, static)), eqx.is_array)[0]

    def add_one_flat(tree):
        return t.add_one(tree)

    def add_one_flat_lock(tree):
        return t.add_one(tree)

    def add_one_eqx(tree):
        return t.add_one(tree)

    def add_one_eqxs(tree):
        return t.add_one(tree)

    def add_one_eqxs_shard(tree):
        return t.add_one(tree)

    return {
        "floor": (jax.jit(on_partition), (dynamic,)),
        "jit+shard": (
            jax.jit(on_partition, in_shardings=s, out_shardings=s),
            (dynamic,),
        ),
        "flat": (flat_jit(add_one_flat), (tree,)),
        "flat+lock": (
            flat_jit(add_one_flat_lock, threading.RLock() if serialized else None),
            (tree,),
        ),
        "eqx": (eqx.filter_jit(add_one_eqx), (tree,)),
        "eqxs": (eqxs.filter_jit(add_one_eqxs), (tree,)),
        "eqxs+shard": (
            eqxs.filter_jit(add_one_eqxs_shard, in_shardings=s, out_shardings=s),
            (tree,),
        ),
    }


def run(cfg: dict) -> dict:
    sample_async = (
        h.sample_async_wall if cfg.get("async_clock") == "wall" else h.sample_async
    )
    cells = {}
    keep_alive = []
    for layout in cfg["layouts"]:
        s = t.sharding(layout)
        for kind in t.TREES:
            for n in cfg["ns"]:
                tree = t.place(t.make_tree(kind, n), s)
                variants = _variants(tree, s)
                keep_alive.append(variants)
                samplers = {}
                for name, (fn, args) in variants.items():
                    inner = h.calibrate(fn, args, cfg["sample_s"], cfg["max_inner"])
                    samplers[(name, "async")] = lambda fn=fn, args=args, inner=inner: (
                        sample_async(fn, args, inner)
                    )
                    samplers[(name, "sync")] = lambda fn=fn, args=args, inner=inner: (
                        h.sample_sync(fn, args, inner)
                    )
                cells[(layout, kind, n)] = samplers
    rounds = cfg["warmup"] + cfg["reps"]
    measured = h.interleaved(
        cells,
        reps=cfg["reps"],
        warmup=cfg["warmup"],
        progress=h.progress_printer("dispatch", rounds, cfg["verbose"]),
    )
    rows = []
    for (layout, kind, n), (medians, samples) in measured.items():
        for mode in MODES:
            seconds = {v: medians[(v, mode)] for v in VARIANTS}
            paired = lambda names, base, mode=mode, samples=samples: h.paired_ratios(
                samples, [(v, mode) for v in names], (base, mode)
            )
            to_floor = paired(VARIANTS, "floor")
            to_eqxs = paired(["eqx"], "eqxs")
            to_eqxs_shard = paired(["eqx"], "eqxs+shard")
            to_flat = paired(["eqxs", "eqxs+shard"], "flat")
            to_flat_lock = paired(["eqxs"], "flat+lock")
            same_code = paired(["flat+lock"], "flat")
            to_jit_shard = paired(["eqxs+shard"], "jit+shard")
            rows.append(
                {
                    "tree": kind,
                    "layout": layout,
                    "n": n,
                    "n_static": t.n_static(n),
                    "mode": mode,
                    "seconds": seconds,
                    "ratio_to_floor": {v: to_floor[(v, mode)] for v in VARIANTS},
                    "eqx_over_eqxs": to_eqxs[("eqx", mode)],
                    "eqx_over_eqxs_shard": to_eqxs_shard[("eqx", mode)],
                    "ratio_to_flat": {
                        v: to_flat[(v, mode)] for v in ("eqxs", "eqxs+shard")
                    },
                    "eqxs_over_flat_lock": to_flat_lock[("eqxs", mode)],
                    "flat_lock_over_flat": same_code[("flat+lock", mode)],
                    "eqxs_shard_over_jit_shard": to_jit_shard[("eqxs+shard", mode)],
                }
            )
    # Issue 48's cells: N up to 100.
    inputs = run_inputs({**cfg, "ns": [n for n in cfg["ns"] if n <= 100]})
    return {
        "variants": list(VARIANTS),
        "modes": list(MODES),
        "rows": rows,
        "inputs": inputs,
        "identity": run_identity(cfg),
    }


def scaling(result: dict) -> list[dict]:
    """Per-leaf cost (µs per array leaf): the least-squares slope of the median time
    against the number of array leaves, over the N sweep."""
    out = []
    groups: dict = {}
    for row in result["rows"]:
        groups.setdefault((row["tree"], row["layout"], row["mode"]), []).append(row)
    for (kind, layout, mode), rows in groups.items():
        if len(rows) < 2:
            continue
        ns = [r["n"] for r in rows]
        per_leaf = {
            v: h.slope(ns, [r["seconds"][v] for r in rows]) * 1e6
            for v in result["variants"]
        }
        out.append(
            {
                "what": "dispatch",
                "tree": kind,
                "layout": layout,
                "mode": mode,
                "us_per_leaf": per_leaf,
            }
        )
    return out


def _marked(value, threshold: float) -> str:
    if value is None:
        return "-"
    return h.fmt(value, "x") + (" pass" if value <= threshold else " FAIL")


def _name(v: str) -> str:
    return NAMES.get(v, v)


def render(result: dict) -> str:
    variants = result["variants"]
    parts = []
    for mode in MODES:
        title = (
            "calling-thread CPU µs per call, asynchronous dispatch"
            if mode == "async"
            else "wall µs per call, synchronous (block_until_ready)"
        )
        marked = mode == "async"  # the targets are for asynchronous dispatch
        headers = [
            "layout",
            "tree",
            "N",
            *map(_name, variants),
            "eqxs/flat sketch" + (f" (<= {TARGET_FLAT}x)" if marked else ""),
            "eqxs/flat sketch+lock",
            "eqxs/floor"
            + (f" (<= {TARGET_FLOOR}x; {TARGET_FLOOR_N1}x at N=1)" if marked else ""),
            *(f"{_name(v)}/floor" for v in variants if v not in ("floor", "eqxs")),
            "eqxs+shard/flat sketch",
            "eqxs+shard/jit+shard",
            "eqx/eqxs",
            "eqx/eqxs+shard",
        ]
        rows = []
        met = {"flat": 0, "floor": 0}
        cells = 0
        for r in result["rows"]:
            if r["mode"] != mode:
                continue
            cells += 1
            to_flat = r["ratio_to_flat"]["eqxs"]
            to_floor = r["ratio_to_floor"]["eqxs"]
            met["flat"] += to_flat is not None and to_flat <= TARGET_FLAT
            met["floor"] += to_floor is not None and to_floor <= floor_target(r["n"])
            rows.append(
                [
                    r["layout"],
                    r["tree"],
                    r["n"],
                    *(h.fmt(r["seconds"][v]) for v in variants),
                    _marked(to_flat, TARGET_FLAT) if marked else h.fmt(to_flat, "x"),
                    h.fmt(r["eqxs_over_flat_lock"], "x"),
                    _marked(to_floor, floor_target(r["n"]))
                    if marked
                    else h.fmt(to_floor, "x"),
                    *(
                        h.fmt(r["ratio_to_floor"][v], "x")
                        for v in variants
                        if v not in ("floor", "eqxs")
                    ),
                    h.fmt(r["ratio_to_flat"]["eqxs+shard"], "x"),
                    h.fmt(r["eqxs_shard_over_jit_shard"], "x"),
                    h.fmt(r["eqx_over_eqxs"], "x"),
                    h.fmt(r["eqx_over_eqxs_shard"], "x"),
                ]
            )
        text = f"### Dispatch: {title}\n\n"
        aa = [
            r["flat_lock_over_flat"]
            for r in result["rows"]
            if r["mode"] == mode and r["layout"] == "single"
        ]
        if marked and aa and None not in aa:
            # On one device the sketch takes no lock: the same code, twice.
            text += (
                "Noise: on single-device cells `flat sketch+lock` takes no lock, so it "
                "is the flat sketch again, measured as a separate function; its ratio "
                f"to the flat sketch ranges {min(aa):.2f}-{max(aa):.2f}x in this "
                "run.\n\n"
            )
        if marked:
            text += (
                "`floor` is `jax.jit` on the pre-partitioned leaves; `flat sketch` is "
                "`benchmarks/flat_jit.py`. Targets (issue 23), per cell: eqxs/flat "
                f"sketch <= {TARGET_FLAT}x ({met['flat']}/{cells} cells pass), "
                f"eqxs/floor <= {TARGET_FLOOR}x at N >= 10 and <= {TARGET_FLOOR_N1}x "
                f"at N = 1 ({met['floor']}/{cells} cells pass).\n\n"
            )
        parts.append(text + h.table(headers, rows))
    if "inputs" in result:
        parts.append(render_inputs(result["inputs"]))
    if "identity" in result:
        parts.append(render_identity(result["identity"]))
    return "\n\n".join(parts)


#
# Inputs as users pass them (issue 48): the same call with `in_shardings` and
# `out_shardings` on uncommitted JAX arrays, NumPy arrays and committed arrays, on one
# device (a one-device mesh, the same `in_shardings` as a many-device program) and on
# every device, against the flat sketch with the same shardings (which hands inputs to
# `jax.jit` as they came) and `jax.jit` on the flat leaves.
#

SOURCES = ("uncommitted", "numpy", "committed")
INPUT_VARIANTS = ("eqxs+shard", "flat+shard", "jit+shard")
# eqxs+shard / flat+shard, asynchronous dispatch, per cell (issue 62): on the CPU 1.1x
# on many devices; on one, 1.3x at N >= 10 and 1.5x at N = 1; on an accelerator 1.15x.
TARGET_INPUTS = 1.1
TARGET_INPUTS_ONE = 1.3
TARGET_INPUTS_ONE_N1 = 1.5
TARGET_INPUTS_DEVICE = 1.15


def inputs_target(row: dict) -> float:
    """Issue 62's target for one cell of `run_inputs`."""
    if row.get("platform", "cpu") != "cpu":
        return TARGET_INPUTS_DEVICE
    if row["devices"] > 1:
        return TARGET_INPUTS
    return TARGET_INPUTS_ONE_N1 if row["n"] == 1 else TARGET_INPUTS_ONE


def _input_sharding(devices: int):
    mesh = jax.make_mesh(
        (devices,),
        ("data",),
        axis_types=(jax.sharding.AxisType.Auto,),
        devices=jax.devices()[:devices],
    )
    return jax.NamedSharding(mesh, jax.P())


def _source(tree, source: str, s):
    if source == "committed":
        return t.place(tree, s)
    if source == "numpy":
        return jax.tree.map(lambda x: np.asarray(x) if eqx.is_array(x) else x, tree)
    return tree  # `make_tree`'s leaves are uncommitted


def _input_variants(tree, s):
    dynamic, static = eqx.partition(tree, eqx.is_array)
    leaves = jax.tree.leaves(dynamic)
    treedef = jax.tree.structure(dynamic)

    def on_leaves(*leaves):
        tree = eqx.combine(jax.tree.unflatten(treedef, leaves), static)
        return jax.tree.leaves(eqx.filter(t.add_one(tree), eqx.is_array))

    def add_one_eqxs(tree):
        return t.add_one(tree)

    def add_one_flat(tree):
        return t.add_one(tree)

    return {
        "eqxs+shard": (
            eqxs.filter_jit(add_one_eqxs, in_shardings=s, out_shardings=s),
            (tree,),
        ),
        "flat+shard": (flat_jit(add_one_flat, sharding=s), (tree,)),
        "jit+shard": (
            jax.jit(on_leaves, in_shardings=s, out_shardings=s),
            tuple(leaves),
        ),
    }


def run_inputs(cfg: dict) -> dict:
    sample_async = (
        h.sample_async_wall if cfg.get("async_clock") == "wall" else h.sample_async
    )
    cells = {}
    keep_alive = []
    for devices in cfg.get("devices", sorted({1, len(jax.devices())})):
        s = _input_sharding(devices)
        for source in SOURCES:
            for kind in t.TREES:
                for n in cfg["ns"]:
                    tree = _source(t.make_tree(kind, n), source, s)
                    variants = _input_variants(tree, s)
                    keep_alive.append(variants)
                    samplers = {}
                    for name, (fn, args) in variants.items():
                        inner = h.calibrate(fn, args, cfg["sample_s"], cfg["max_inner"])
                        samplers[(name, "async")] = (
                            lambda fn=fn, args=args, inner=inner: sample_async(
                                fn, args, inner
                            )
                        )
                    cells[(devices, source, kind, n)] = samplers
    measured = h.interleaved(
        cells,
        reps=cfg["reps"],
        warmup=cfg["warmup"],
        progress=h.progress_printer(
            "dispatch inputs", cfg["warmup"] + cfg["reps"], cfg["verbose"]
        ),
    )
    rows = []
    for (devices, source, kind, n), (medians, samples) in measured.items():
        ratios = h.paired_ratios(
            samples,
            [("eqxs+shard", "async"), ("jit+shard", "async")],
            ("flat+shard", "async"),
        )
        rows.append(
            {
                "devices": devices,
                "platform": jax.default_backend(),
                "source": source,
                "tree": kind,
                "n": n,
                "seconds": {v: medians[(v, "async")] for v in INPUT_VARIANTS},
                "eqxs_over_flat": ratios[("eqxs+shard", "async")],
                "jit_over_flat": ratios[("jit+shard", "async")],
            }
        )
    return {
        "variants": list(INPUT_VARIANTS),
        "rows": rows,
        "clock": cfg.get("async_clock", "thread"),
    }


def render_inputs(result: dict) -> str:
    headers = [
        "devices",
        "inputs",
        "tree",
        "N",
        "eqxs+shard",
        "flat sketch+shard",
        "jit+shard",
        "eqxs+shard/flat sketch+shard",
        "target",
    ]
    rows = []
    met = 0
    for r in result["rows"]:
        ratio, target = r["eqxs_over_flat"], inputs_target(r)
        met += ratio is not None and ratio <= target
        rows.append(
            [
                r["devices"],
                r["source"],
                r["tree"],
                r["n"],
                *(h.fmt(r["seconds"][v]) for v in INPUT_VARIANTS),
                _marked(ratio, target),
                f"<= {target}x",
            ]
        )
    clock = "wall-clock" if result.get("clock") == "wall" else "calling-thread CPU"
    text = (
        f"### Dispatch of inputs as users pass them: {clock} µs per call, "
        "asynchronous dispatch\n\n"
        "All three with `in_shardings` and `out_shardings` replicated on the devices "
        "given; `jax.jit` on the flat leaves moves a one-device uncommitted input at "
        "no cost, so it is not a floor there. Targets (issue 62), eqxs/flat sketch "
        f"per cell: on the CPU <= {TARGET_INPUTS}x on many devices, on one <= "
        f"{TARGET_INPUTS_ONE}x at N >= 10 and <= {TARGET_INPUTS_ONE_N1}x at N = 1; "
        f"on an accelerator <= {TARGET_INPUTS_DEVICE}x ({met}/{len(rows)} cells pass)."
        "\n\n"
    )
    return text + h.table(headers, rows)


#
# Equinox#973's scenario: `eqx.nn.Identity` on a `(1, 1)` array, one CPU device,
# synchronous (each call waited for), against `jax.jit` of the same Module; with
# shardings, both given the same one-device sharding (the input uncommitted).
#

IDENTITY_VARIANTS = ("jit", "eqxs", "jit+shard", "eqxs+shard", "eqx")
TARGET_IDENTITY = 1.5  # eqxs / jit and eqxs+shard / jit+shard, synchronous


def run_identity(cfg: dict) -> dict:
    model = eqx.nn.Identity()
    x = jax.numpy.ones((1, 1))  # uncommitted: on the first device
    s = _input_sharding(1)
    variants = {
        "jit": jax.jit(model),
        "eqxs": eqxs.filter_jit(model),
        "jit+shard": jax.jit(model, in_shardings=s, out_shardings=s),
        "eqxs+shard": eqxs.filter_jit(model, in_shardings=s, out_shardings=s),
        "eqx": eqx.filter_jit(model),
    }
    samplers = {}
    for name, fn in variants.items():
        inner = h.calibrate(fn, (x,), cfg["sample_s"], cfg["max_inner"])
        samplers[name] = lambda fn=fn, inner=inner: h.sample_sync(fn, (x,), inner)
    ((medians, samples),) = h.interleaved(
        {"identity": samplers},
        reps=cfg["reps"],
        warmup=cfg["warmup"],
        progress=h.progress_printer(
            "dispatch identity", cfg["warmup"] + cfg["reps"], cfg["verbose"]
        ),
    ).values()
    to_jit = h.paired_ratios(samples, ["eqxs", "eqxs+shard", "eqx"], "jit")
    to_jit_shard = h.paired_ratios(samples, ["eqxs+shard"], "jit+shard")
    return {
        "seconds": medians,
        "eqxs_over_jit": to_jit["eqxs"],
        "eqxs_shard_over_jit_shard": to_jit_shard["eqxs+shard"],
        "eqxs_shard_over_jit": to_jit["eqxs+shard"],
        "eqx_over_jit": to_jit["eqx"],
    }


def render_identity(result: dict) -> str:
    seconds = result["seconds"]
    headers = [
        *IDENTITY_VARIANTS,
        f"eqxs/jit (<= {TARGET_IDENTITY}x)",
        f"eqxs+shard/jit+shard (<= {TARGET_IDENTITY}x)",
        "eqxs+shard/jit",
        "eqx/jit",
    ]
    row = [
        *(h.fmt(seconds[v]) for v in IDENTITY_VARIANTS),
        _marked(result["eqxs_over_jit"], TARGET_IDENTITY),
        _marked(result["eqxs_shard_over_jit_shard"], TARGET_IDENTITY),
        h.fmt(result["eqxs_shard_over_jit"], "x"),
        h.fmt(result["eqx_over_jit"], "x"),
    ]
    text = (
        "### Equinox#973: `eqx.nn.Identity` on a `(1, 1)` array, wall µs per call, "
        "synchronous\n\n"
        "One device; with shardings, a one-device mesh's replicated sharding for the "
        "input (uncommitted) and the output.\n\n"
    )
    return text + h.table(headers, [row])


if __name__ == "__main__":
    options = h.standalone_options(
        "issue 48's dispatch cells", reps={"type": int, "default": 9}
    )
    config = {
        # A TPU host's thread CPU clock read 0 for whole samples.
        "async_clock": "wall" if options.device else "thread",
        "ns": (1, 10) if options.quick else (1, 10, 100),
        "sample_s": 0.002 if options.quick else 0.02,
        "max_inner": 50 if options.quick else 2000,
        "reps": 1 if options.quick else options.reps,
        "warmup": 1,
        "verbose": True,
    }
    print(render_inputs(run_inputs(config)))
    print()
    print(render_identity(run_identity(config)))
