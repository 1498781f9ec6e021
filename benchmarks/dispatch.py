"""Host dispatch of an already-compiled function whose body is trivial (add one to every
array leaf), so that the time is the Python and C++ work around the computation.

Variants, all called on the same placed (committed) inputs:

- `floor`: `jax.jit` on the array partition, made once up front (the non-array part
    closed over): what a hand-written program pays at the least.
- `jit+shard`: the same, with `in_shardings`/`out_shardings`.
- `eqx`: `equinox.filter_jit`.
- `eqxs`: `equinox_shard.filter_jit` without shardings.
- `eqxs+shard`: `equinox_shard.filter_jit` with `in_shardings`/`out_shardings`.

Modes: `async` is the calling thread's CPU time per call (`time.thread_time`) with
asynchronous dispatch; `sync` is wall time per call, each call waited for.
"""

import equinox as eqx
import equinox_shard as eqxs
import jax

from . import _harness as h, _trees as t


VARIANTS = ("floor", "jit+shard", "eqx", "eqxs", "eqxs+shard")
MODES = ("async", "sync")


def _variants(tree, s):
    dynamic, static = eqx.partition(tree, eqx.is_array)

    def on_partition(dynamic):
        return eqx.partition(t.add_one(eqx.combine(dynamic, static)), eqx.is_array)[0]

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
        "eqx": (eqx.filter_jit(add_one_eqx), (tree,)),
        "eqxs": (eqxs.filter_jit(add_one_eqxs), (tree,)),
        "eqxs+shard": (
            eqxs.filter_jit(add_one_eqxs_shard, in_shardings=s, out_shardings=s),
            (tree,),
        ),
    }


def run(cfg: dict) -> dict:
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
                        h.sample_async(fn, args, inner)
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
                }
            )
    return {"variants": list(VARIANTS), "modes": list(MODES), "rows": rows}


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


def render(result: dict) -> str:
    parts = []
    for mode in MODES:
        title = (
            "calling-thread CPU µs per call, asynchronous dispatch"
            if mode == "async"
            else "wall µs per call, synchronous (block_until_ready)"
        )
        headers = [
            "layout",
            "tree",
            "N",
            *VARIANTS,
            *(f"{v}/floor" for v in VARIANTS[1:]),
            "eqx/eqxs",
            "eqx/eqxs+shard",
        ]
        rows = []
        for r in result["rows"]:
            if r["mode"] != mode:
                continue
            rows.append(
                [
                    r["layout"],
                    r["tree"],
                    r["n"],
                    *(h.fmt(r["seconds"][v]) for v in VARIANTS),
                    *(h.fmt(r["ratio_to_floor"][v], "x") for v in VARIANTS[1:]),
                    h.fmt(r["eqx_over_eqxs"], "x"),
                    h.fmt(r["eqx_over_eqxs_shard"], "x"),
                ]
            )
        parts.append(f"### Dispatch: {title}\n\n" + h.table(headers, rows))
    return "\n\n".join(parts)
