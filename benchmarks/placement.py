"""Eager placement of a whole `eqx.Module` tree on a sharding, outside any trace.

Variants:

- `device_put`: `jax.device_put` on the array partition, made once up front (the
    floor: what a hand-written program pays at the least).
- `copy`: `jax.device_put(..., may_alias=False)` on the partition: what a copy that
    owns its buffers costs (JAX still shares a single-device buffer with a replicated
    target here, so this floor is slightly low).
- `owned`: the least that public JAX needs for results that own every buffer:
    `copy` where no result shares a source buffer, else a copy on the source's own
    device first, then `jax.device_put` of that copy (replicated from uncommitted
    arrays: the one case where `copy` hands back a source buffer).
- `eqxs.fdp`: `equinox_shard.filter_device_put` (its results own their buffers: it
    keeps the caller's buffer, so from uncommitted arrays its like-for-like floor is
    `owned`, one extra device copy out of eight onto a replicated sharding).
- `fdp alias`: `equinox_shard.filter_device_put(..., may_alias=True)`, which lets its
    results share the caller's buffers as `jax.device_put` does: the wrapper's cost
    alone.
- `eqxs.fs`: `equinox_shard.filter_shard` (eager).
- `eqx.fs`: `equinox.filter_shard` (eager: `with_sharding_constraint` per leaf).

Sources: `uncommitted` arrays on the default device, or arrays `placed` (committed)
on the target sharding already. Each call is waited for (wall time, µs per call).
`same` is the fraction of output array leaves that are the very objects of the input.

Targets, per cell (issue 41), for `eqxs.fdp` and `eqxs.fs`: at most 1.05x `copy` from
uncommitted arrays, at most 0.5x `device_put` from placed ones (returned as they are);
also reported against `owned`, the like-for-like floor where `copy` shares a buffer.
"""

import equinox as eqx
import equinox_shard as eqxs
import jax

from . import _harness as h, _trees as t


VARIANTS = (
    "device_put",
    "copy",
    "owned",
    "eqxs.fdp",
    "fdp alias",
    "eqxs.fs",
    "eqx.fs",
)
SOURCES = ("uncommitted", "placed")
# Per cell, by source: (the variant compared with, at most this ratio).
TARGETS = {"uncommitted": ("copy", 1.05), "placed": ("device_put", 0.5)}
# The variants held to the targets.
HELD = ("eqxs.fdp", "eqxs.fs")


def _buffers(tree) -> set:
    return {
        shard.data.unsafe_buffer_pointer()
        for x in jax.tree.leaves(tree)
        for shard in x.addressable_shards
    }


def _owned(dynamic, s):
    """`owned` (see the module's docstring): a callable."""
    copy = jax.device_put(dynamic, s, may_alias=False)
    if _buffers(copy).isdisjoint(_buffers(dynamic)):
        return lambda: jax.device_put(dynamic, s, may_alias=False)
    own = jax.tree.map(lambda x: x.sharding, dynamic)
    return lambda: jax.device_put(jax.device_put(dynamic, own, may_alias=False), s)


def _variants(tree, s, n, cfg):
    dynamic, _ = eqx.partition(tree, eqx.is_array)
    out = {
        "device_put": (lambda: jax.device_put(dynamic, s), dynamic),
        "copy": (lambda: jax.device_put(dynamic, s, may_alias=False), dynamic),
        "owned": (_owned(dynamic, s), dynamic),
        "eqxs.fdp": (lambda: eqxs.filter_device_put(tree, s), tree),
        "fdp alias": (lambda: eqxs.filter_device_put(tree, s, may_alias=True), tree),
        "eqxs.fs": (lambda: eqxs.filter_shard(tree, s), tree),
    }
    if n <= cfg["eqx_shard_max_n"]:
        # `with_sharding_constraint` outside jit dispatches one `jit` per leaf, about
        # a millisecond each: too slow for the largest trees.
        out["eqx.fs"] = (lambda: eqx.filter_shard(tree, s), tree)
    return out


def run(cfg: dict) -> dict:
    cells = {}
    same = {}
    same_static = {}
    for layout in cfg["layouts"]:
        s = t.sharding(layout)
        for source in SOURCES:
            for n in cfg["ns"]:
                key = (layout, source, n)
                tree = t.make_tree("module", n)
                if source == "placed":
                    tree = t.place(tree, s)
                variants = _variants(tree, s, n, cfg)
                same[key] = {}
                same_static[key] = {}
                samplers = {}
                for name, (fn, before) in variants.items():
                    after = jax.block_until_ready(fn())  # also compiles, if anything
                    same[key][name] = t.identity_fraction(before, after)
                    if name not in ("device_put", "copy", "owned"):
                        same_static[key][name] = t.static_identity_fraction(
                            before, after
                        )
                    del after
                    inner = h.calibrate(fn, (), cfg["sample_s"], cfg["max_inner"])
                    samplers[name] = lambda fn=fn, inner=inner: h.sample_sync(
                        fn, (), inner
                    )
                cells[key] = samplers
    rounds = cfg["warmup"] + cfg["reps"]
    measured = h.interleaved(
        cells,
        reps=cfg["reps"],
        warmup=cfg["warmup"],
        progress=h.progress_printer("placement", rounds, cfg["verbose"]),
    )
    rows = []
    for (layout, source, n), (medians, samples) in measured.items():
        key = (layout, source, n)
        rows.append(
            {
                "layout": layout,
                "source": source,
                "n": n,
                "seconds": {v: medians.get(v) for v in VARIANTS},
                "ratio_to_device_put": h.paired_ratios(
                    samples, list(VARIANTS), "device_put"
                ),
                "fdp_over_copy": h.paired_ratios(samples, ["eqxs.fdp"], "copy")[
                    "eqxs.fdp"
                ],
                "ratio_to_copy": h.paired_ratios(samples, list(HELD), "copy"),
                "ratio_to_owned": h.paired_ratios(samples, list(HELD), "owned"),
                "same_object": {v: same[key].get(v) for v in VARIANTS},
                "same_object_non_array": same_static[key],
            }
        )
    return {"variants": list(VARIANTS), "rows": rows}


def scaling(result: dict) -> list[dict]:
    out = []
    groups: dict = {}
    for row in result["rows"]:
        groups.setdefault((row["layout"], row["source"]), []).append(row)
    for (layout, source), rows in groups.items():
        per_leaf = {}
        for v in result["variants"]:
            points = [(r["n"], r["seconds"][v]) for r in rows if r["seconds"][v]]
            if len(points) >= 2:
                ns, ys = zip(*points)
                per_leaf[v] = h.slope(list(ns), list(ys)) * 1e6
            else:
                per_leaf[v] = None
        if len(rows) >= 2:
            out.append(
                {
                    "what": "placement",
                    "tree": "module",
                    "layout": layout,
                    "mode": source,
                    "us_per_leaf": per_leaf,
                }
            )
    return out


def target_ratio(row: dict, variant: str) -> tuple[float | None, str, float]:
    """`(ratio, compared with, threshold)` of `variant`'s target in `row`."""
    base, threshold = TARGETS[row["source"]]
    ratios = row["ratio_to_copy"] if base == "copy" else row["ratio_to_device_put"]
    return ratios.get(variant), base, threshold


def render(result: dict) -> str:
    variants = result["variants"]
    others = [v for v in variants if v not in ("device_put", "eqxs.fdp")]
    headers = [
        "layout",
        "from",
        "N",
        *variants,
        *(f"{v} (target)" for v in HELD),
        "eqxs.fdp/copy",
        "eqxs.fdp/owned",
        *(f"{v}/device_put" for v in others),
        *(f"same {v}" for v in variants),
    ]
    rows = []
    met = cells = 0
    for r in result["rows"]:
        ratios = r["ratio_to_device_put"]
        marks = []
        for v in HELD:
            value, base, threshold = target_ratio(r, v)
            cells += 1
            ok = value is not None and value <= threshold
            met += ok
            marks.append(
                "-"
                if value is None
                else f"{h.fmt(value, 'x')} {base} (<= {threshold}x) "
                + ("pass" if ok else "FAIL")
            )
        rows.append(
            [
                r["layout"],
                r["source"],
                r["n"],
                *(h.fmt(r["seconds"].get(v)) for v in variants),
                *marks,
                h.fmt(r.get("fdp_over_copy"), "x"),
                h.fmt(r["ratio_to_owned"].get("eqxs.fdp"), "x"),
                *(h.fmt(ratios.get(v), "x") for v in others),
                *(h.fmt(r["same_object"].get(v), "pct") for v in variants),
            ]
        )
    (base_u, t_u), (base_p, t_p) = TARGETS["uncommitted"], TARGETS["placed"]
    return (
        "### Eager placement: wall µs per call (Module tree)\n\n"
        f"Target per cell (issue 41), for {' and '.join(HELD)}: <= {t_u}x `{base_u}` "
        f"from uncommitted arrays, <= {t_p}x `{base_p}` from placed ones "
        f"({met}/{cells} pass). `owned` is what keeping the caller's buffer costs at "
        "the least: `copy`, except replicated from uncommitted arrays, where `copy` "
        "hands back the source's buffer on its device.\n\n" + h.table(headers, rows)
    )
