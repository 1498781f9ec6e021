"""`equinox_shard.filter_shard_map` against `jax.shard_map` on the `eqx.partition`ed
tree, with the same trivial body (add one to every array leaf, inside the map).

Variants, all called on the same placed (committed) inputs:

- `jax`: `jax.shard_map` over the array partition, made once up front (the non-array
    part closed over): what a hand-written program does.
- `eqxs`: `equinox_shard.filter_shard_map` over the whole tree.

Contexts:

- `eager`: the mapped function is called directly. `jax.shard_map` traces and
    compiles its body on every eager call, and so does `filter_shard_map` (which calls
    it); this is wall time per call, waited for, measured up to `N = 10` only (it
    grows with N by about 90 ms per leaf on the development machine).
- `jit`: each is wrapped once in a JIT (`jax.jit` around `jax.shard_map`,
    `equinox_shard.filter_jit` around `filter_shard_map`); calling-thread CPU time per
    call, asynchronous dispatch, as `dispatch.py` measures.

Each cell also records whether both variants return the same numbers (`equal`).
"""

import equinox as eqx
import equinox_shard as eqxs
import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from . import _harness as h, _trees as t


VARIANTS = ("jax", "eqxs")
CONTEXTS = ("eager", "jit")
SPECS = {"replicated": P(), "batch": P("data")}


def _variants(tree, spec, mesh):
    dynamic, static = eqx.partition(tree, eqx.is_array)

    def on_partition(dynamic):
        return eqx.partition(t.add_one(eqx.combine(dynamic, static)), eqx.is_array)[0]

    theirs = jax.shard_map(on_partition, mesh=mesh, in_specs=spec, out_specs=spec)
    ours = eqxs.filter_shard_map(t.add_one, mesh=mesh, in_specs=spec, out_specs=spec)
    return {
        ("jax", "eager"): (theirs, (dynamic,)),
        ("eqxs", "eager"): (ours, (tree,)),
        ("jax", "jit"): (jax.jit(theirs), (dynamic,)),
        ("eqxs", "jit"): (eqxs.filter_jit(ours), (tree,)),
    }


def _equal(variants) -> bool:
    out = {}
    for key, (fn, args) in variants.items():
        out[key] = [np.asarray(x) for x in t.array_leaves(fn(*args))]
    first, *rest = out.values()
    return all(
        len(o) == len(first) and all(np.array_equal(a, b) for a, b in zip(o, first))
        for o in rest
    )


def run(cfg: dict) -> dict:
    mesh = t.mesh()
    cells = {}
    equal = {}
    keep_alive = []
    for layout, spec in SPECS.items():
        s = t.sharding(layout)
        for n in cfg["ns"]:
            tree = t.place(t.make_tree("module", n), s)
            variants = _variants(tree, spec, mesh)
            if n > cfg.get("shard_map_eager_max_n", 10):
                variants = {k: v for k, v in variants.items() if k[1] == "jit"}
            keep_alive.append(variants)
            equal[(layout, n)] = _equal(variants)
            samplers = {}
            for (name, context), (fn, args) in variants.items():
                inner = h.calibrate(fn, args, cfg["sample_s"], cfg["max_inner"])
                sample = h.sample_sync if context == "eager" else h.sample_async
                samplers[(name, context)] = (
                    lambda fn=fn, args=args, inner=inner, sample=sample: sample(
                        fn, args, inner
                    )
                )
            cells[(layout, n)] = samplers
    rounds = cfg["warmup"] + cfg["reps"]
    measured = h.interleaved(
        cells,
        reps=cfg["reps"],
        warmup=cfg["warmup"],
        progress=h.progress_printer("shard_map", rounds, cfg["verbose"]),
    )
    rows = []
    for (layout, n), (medians, samples) in measured.items():
        for context in CONTEXTS:
            if ("jax", context) not in medians:
                continue
            ratio = h.paired_ratios(samples, [("eqxs", context)], ("jax", context))
            rows.append(
                {
                    "layout": layout,
                    "n": n,
                    "context": context,
                    "seconds": {v: medians[(v, context)] for v in VARIANTS},
                    "eqxs_over_jax": ratio[("eqxs", context)],
                    "equal": equal[(layout, n)],
                }
            )
    return {"variants": list(VARIANTS), "contexts": list(CONTEXTS), "rows": rows}


def render(result: dict) -> str:
    headers = ["context", "layout", "N", "jax.shard_map", "filter_shard_map"]
    headers += ["eqxs/jax", "same numbers"]
    rows = [
        [
            r["context"],
            r["layout"],
            r["n"],
            h.fmt(r["seconds"]["jax"]),
            h.fmt(r["seconds"]["eqxs"]),
            h.fmt(r["eqxs_over_jax"], "x"),
            "yes" if r["equal"] else "NO",
        ]
        for r in result["rows"]
    ]
    return (
        "### filter_shard_map vs jax.shard_map on the partition\n\n"
        "µs per call: eager is wall time, waited for; jit is calling-thread CPU "
        "time with asynchronous dispatch.\n\n" + h.table(headers, rows)
    )
