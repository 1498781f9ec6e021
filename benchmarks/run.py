"""Runs every benchmark in one process, prints the tables (Markdown) and writes JSON.

    python -m benchmarks            # the full run: a few minutes
    python -m benchmarks --quick    # a smoke run: seconds, numbers meaningless
    python -m benchmarks --device   # on JAX's default backend (an accelerator)

The simulated devices are set up here, before JAX computes anything. `--device` runs
`benchmarks/device.py` instead of the sections, on JAX's default backend (with
`--quick`, sizes scaled down: a CPU runs it in under a minute).
"""

import argparse
import json
import os
import pathlib
import sys
import time
from statistics import median


DEFAULT_JSON = pathlib.Path(__file__).parent / "results" / "latest.json"

SECTIONS = ("dispatch", "callbacks", "placement", "compiles", "step", "shard_map")
# Run only when asked for (`--only checkpoint pipeline`): the first needs
# orbax-checkpoint, the second optax and trains the transformer example three times.
OPTIONAL_SECTIONS = ("checkpoint", "pipeline")

FULL = {
    "ns": [1, 10, 100, 1000],
    "layouts": ["replicated", "batch", "single"],
    "reps": 21,
    "warmup": 2,
    "sample_s": 0.003,
    "max_inner": 200,
    "eqx_shard_max_n": 100,
    "compile_calls": 100,
    "step": {
        "vocab": 256,
        "length": 32,
        "width": 256,
        "heads": 4,
        "depth": 4,
        "batch": 8,
        "reps": 30,
        "warmup": 2,
    },
    "checkpoint": {"reps": 11, "warmup": 1, "vocab": 1024},  # 3.68M parameters
}

QUICK = {
    "ns": [1, 10],
    "layouts": ["batch", "single"],
    "reps": 2,
    "warmup": 1,
    "sample_s": 0.0002,
    "max_inner": 5,
    "eqx_shard_max_n": 10,
    "compile_calls": 5,
    "step": {
        "vocab": 16,
        "length": 8,
        "width": 16,
        "heads": 2,
        "depth": 1,
        "batch": 8,
        "reps": 2,
        "warmup": 1,
    },
    "checkpoint": {"reps": 2, "warmup": 1, "cold_rounds": 1},
}

# (section, description, threshold, how the value is read from the results)
TARGET_DISPATCH_FLOOR = 1.25
TARGET_DISPATCH_VS_EQX = 2.0
TARGET_STEP = 1.02
TARGET_CHECKPOINT = 1.1
TARGET_COLD_RESTORE = 1.5  # the first restore in a fresh process (issue 44)


def _targets(results: dict) -> list[dict]:
    out = []

    def add(name, value, threshold, *, at_most, detail, values=None):
        if value is None:
            return
        met = value <= threshold if at_most else value >= threshold
        out.append(
            {
                "target": name,
                "value": value,
                "median_over_cells": None if values is None else median(values),
                "threshold": threshold,
                "at_most": at_most,
                "met": met,
                "detail": detail,
            }
        )

    def add_worst(name, rows, value, threshold, detail, *, at_most=True):
        # The worst row against a target: the largest value for a ceiling, the
        # smallest for a floor; the median over all rows goes with it.
        values = [value(r) for r in rows]
        if not rows or None in values:
            return
        pick = max if at_most else min
        k = pick(range(len(rows)), key=values.__getitem__)
        add(
            name,
            values[k],
            threshold,
            at_most=at_most,
            detail=detail(rows[k]),
            values=values,
        )

    def cell(r):
        return f"{r['layout']} {r['tree']} N={r['n']}"

    if "dispatch" in results and "inputs" in results["dispatch"]:
        from .dispatch import inputs_target

        # Issue 62's targets differ per cell: the worst cell by its own target.
        add_worst(
            "dispatch of inputs as users pass them eqxs/flat sketch over the cell's "
            "target, worst (issue 62)",
            results["dispatch"]["inputs"]["rows"],
            lambda r: r["eqxs_over_flat"] / inputs_target(r),
            1.0,
            lambda r: (
                f"{r['devices']} devices, {r['source']} {r['tree']} N={r['n']}: "
                f"{r['eqxs_over_flat']:.2f}x, target {inputs_target(r)}x"
            ),
        )
    if "dispatch" in results and "identity" in results["dispatch"]:
        from .dispatch import TARGET_IDENTITY

        identity = results["dispatch"]["identity"]
        for key, what in [
            ("eqxs_over_jit", "eqxs/jax.jit"),
            ("eqxs_shard_over_jit_shard", "eqxs+shard/jax.jit+shard"),
        ]:
            add(
                f"Equinox#973 (eqx.nn.Identity, synchronous) {what}",
                identity[key],
                TARGET_IDENTITY,
                at_most=True,
                detail="one device, a (1, 1) array",
            )
    if "dispatch" in results:
        rows = results["dispatch"]["rows"]
        # Issue 23: eqxs, asynchronous dispatch, against the flat sketch and the floor.
        from .dispatch import TARGET_FLAT, TARGET_FLOOR, TARGET_FLOOR_N1

        sel = [r for r in rows if r["mode"] == "async"]
        add_worst(
            "dispatch eqxs/flat sketch (async), worst cell",
            sel,
            lambda r: r["ratio_to_flat"]["eqxs"],
            TARGET_FLAT,
            cell,
        )
        if sel and all(r.get("eqxs_over_flat_lock") for r in sel):
            add_worst(
                "dispatch eqxs/flat sketch+lock (async), worst cell",
                sel,
                lambda r: r["eqxs_over_flat_lock"],
                TARGET_FLAT,
                cell,
            )
        for label, threshold, cells in (
            ("N = 1", TARGET_FLOOR_N1, [r for r in sel if r["n"] == 1]),
            ("N >= 10", TARGET_FLOOR, [r for r in sel if r["n"] >= 10]),
        ):
            add_worst(
                f"dispatch eqxs/floor (async), {label}, worst cell",
                cells,
                lambda r: r["ratio_to_floor"]["eqxs"],
                threshold,
                cell,
            )
        for variant in ("eqxs", "eqxs+shard"):
            for mode in ("async", "sync"):
                if (variant, mode) == ("eqxs", "async"):
                    continue  # replaced by issue 23's targets above
                add_worst(
                    f"dispatch {variant}/floor ({mode}), worst N",
                    [r for r in rows if r["mode"] == mode],
                    lambda r, v=variant: r["ratio_to_floor"][v],
                    TARGET_DISPATCH_FLOOR,
                    cell,
                )
        for variant, key in (
            ("eqxs", "eqx_over_eqxs"),
            ("eqxs+shard", "eqx_over_eqxs_shard"),
        ):
            add_worst(
                f"dispatch eqx/{variant} speed-up (async), N <= 10, worst",
                [r for r in rows if r["n"] <= 10 and r["mode"] == "async"],
                lambda r, key=key: r[key],
                TARGET_DISPATCH_VS_EQX,
                cell,
                at_most=False,
            )
    if "callbacks" in results:
        from .callbacks import TARGET as CALLBACKS

        add_worst(
            "callbacks eqxs/eqx, worst kind",
            results["callbacks"]["rows"],
            lambda r: r["eqxs_over_eqx"],
            CALLBACKS,
            lambda r: r["kind"],
        )
    if "placement" in results:
        from .placement import HELD, target_ratio, TARGETS as PLACE

        rows = results["placement"]["rows"]

        for variant in HELD:
            for source, (base, threshold) in PLACE.items():
                sel = [r for r in rows if r["source"] == source]
                for against, ratio in (
                    (base, lambda r, v=variant: target_ratio(r, v)[0]),
                    ("owned", lambda r, v=variant: r["ratio_to_owned"].get(v)),
                ):
                    if against == "owned" and source != "uncommitted":
                        continue
                    add_worst(
                        f"placement {variant}/{against} from {source}, worst cell",
                        sel,
                        ratio,
                        threshold,
                        lambda r: f"{r['layout']} N={r['n']}",
                    )
                if source == "placed":
                    least = min(r["same_object"][variant] for r in sel)
                    add(
                        f"placement {variant} identity on placed trees, least",
                        least,
                        1.0,
                        at_most=False,
                        detail="fraction of array leaves returned as the same object",
                    )
    if "compiles" in results:
        counts = results["compiles"]["counts"]
        worst = max(counts[s]["eqxs+shard"] for s in counts)
        add(
            "compilations of eqxs+shard, worst scenario",
            worst,
            1,
            at_most=True,
            detail=", ".join(f"{s}: {counts[s]['eqxs+shard']}" for s in counts),
        )
    if "step" in results:
        add(
            "training step eqxs/jit",
            results["step"]["ratio_to_jit"]["eqxs"],
            TARGET_STEP,
            at_most=True,
            detail=f"{results['step']['n_params'] / 1e6:.2f}M parameters",
        )
        from .step import TARGET_FEEDS

        add_worst(
            "training step fed a fresh batch eqxs/jit, worst (issue 48)",
            results["step"].get("feeds", {}).get("rows", []),
            lambda r: r["eqxs_over_jit"],
            TARGET_FEEDS,
            lambda r: f"{r['devices']} devices, {r['feed']}",
        )
    if "checkpoint" in results:
        for what in ("save", "restore"):
            add(
                f"checkpoint {what} eqxs/orbax",
                results["checkpoint"][f"{what}_ratio_to_orbax"]["eqxs"],
                TARGET_CHECKPOINT,
                at_most=True,
                detail=f"{results['checkpoint']['n_params'] / 1e6:.2f}M parameters "
                "and Adam state",
            )
        add(
            "checkpoint first restore in a fresh process eqxs/orbax",
            results["checkpoint"]["cold_restore_ratio_to_orbax"]["eqxs"],
            TARGET_COLD_RESTORE,
            at_most=True,
            detail="child processes",
        )
    return out


def _render_targets(targets: list[dict]) -> str:
    from ._harness import table

    rows = []
    for t in targets:
        value = t["value"]
        shown = f"{value:.2f}" if isinstance(value, float) else str(value)
        typical = t["median_over_cells"]
        rows.append(
            [
                t["target"],
                shown,
                "-" if typical is None else f"{typical:.2f}",
                ("<= " if t["at_most"] else ">= ") + str(t["threshold"]),
                "met" if t["met"] else "MISSED",
                t["detail"],
            ]
        )
    return (
        "### Targets\n\nThe value is the worst cell; the median over all cells of the "
        "same kind shows how much of that is noise.\n\n"
        + table(["target", "value", "median", "threshold", "", "where"], rows)
    )


def _render_scaling(scaling: list[dict]) -> str:
    from ._harness import table

    variants: list[str] = []
    for s in scaling:
        for v in s["us_per_leaf"]:
            if v not in variants:
                variants.append(v)
    rows = [
        [
            s["what"],
            s["layout"],
            s["tree"],
            s["mode"],
            *(
                "-" if s["us_per_leaf"].get(v) is None else f"{s['us_per_leaf'][v]:.2f}"
                for v in variants
            ),
        ]
        for s in scaling
    ]
    return "### Scaling: µs per array leaf (least-squares slope over N)\n\n" + table(
        ["what", "layout", "tree", "mode", *variants], rows
    )


def _load(values) -> str:
    return "/".join(f"{x:.1f}" for x in values) if values else "?"


def _device(args) -> dict:
    import jax

    # Only a CPU backend reads this: an accelerator's devices are its own.
    jax.config.update("jax_num_cpu_devices", 8)

    from . import _harness as h, device

    cfg = dict(device.QUICK if args.quick else device.FULL)
    cfg["verbose"] = not args.quiet
    names = {
        "dispatch": "dispatch",
        "step": "training step",
        "checkpoint": "checkpoint",
    }
    cfg["only"] = None if args.only is None else [names.get(n, n) for n in args.only]
    command = "python -m benchmarks --device" + (" --quick" if args.quick else "")
    if args.only is not None:
        command += " --only " + " ".join(args.only)
    start = time.perf_counter()
    results: dict = {"meta": {**h.machine(), "command": command, "quick": args.quick}}
    results["device"] = device.run(cfg)
    meta = results["meta"]
    meta["seconds"] = time.perf_counter() - start
    kind = jax.devices()[0].device_kind
    print(
        f"`{command}` on {meta['devices']} x {kind} ({meta['platform']}), "
        f"{meta['nproc']} x {meta['cpu']}, jax {meta['jax']}, equinox "
        f"{meta['equinox']}, python {meta['python']}, {meta['date']}, "
        f"{meta['seconds']:.0f} s; load average {_load(meta.get('loadavg_at_start'))} "
        "at the start.\n\n" + device.render(results["device"])
    )
    name = "device-quick.json" if args.quick else "device.json"
    json_path = args.json or DEFAULT_JSON.with_name(name)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(results, indent=1, default=str) + "\n")
    if cfg["verbose"]:
        print(f"wrote {json_path}", file=sys.stderr)
    return results


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny smoke run")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=SECTIONS + OPTIONAL_SECTIONS,
        default=None,
        help="run only these sections (with --device: dispatch, step, checkpoint)",
    )
    parser.add_argument("--json", type=pathlib.Path, default=None, help="output file")
    parser.add_argument("--reps", type=int, default=None, help="override repetitions")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    parser.add_argument(
        "--device",
        action="store_true",
        help="the accelerator run (benchmarks/device.py), on JAX's default backend",
    )
    args = parser.parse_args(argv)

    import jax

    if args.device:
        return _device(args)
    if args.only is None:
        args.only = list(SECTIONS)

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 8)

    from . import (
        _harness as h,
        callbacks,
        compiles,
        dispatch,
        placement,
        shard_map,
        step,
    )

    if "checkpoint" in args.only:
        from . import checkpoint

    cfg = dict(QUICK if args.quick else FULL)
    if args.reps is not None:
        cfg["reps"] = args.reps
    cfg["verbose"] = not args.quiet
    json_path = args.json or (
        DEFAULT_JSON.with_name("quick.json") if args.quick else DEFAULT_JSON
    )

    start = time.perf_counter()
    results: dict = {
        "meta": {
            **h.machine(),
            "command": "python -m benchmarks" + (" --quick" if args.quick else ""),
            "quick": args.quick,
            "config": {k: v for k, v in cfg.items() if k != "verbose"},
        }
    }
    sections = {
        "dispatch": dispatch,
        "callbacks": callbacks,
        "placement": placement,
        "compiles": compiles,
        "step": step,
        "shard_map": shard_map,
    }
    if "checkpoint" in args.only:
        sections["checkpoint"] = checkpoint  # pyright: ignore[reportPossiblyUnboundVariable]
    if "pipeline" in args.only:
        from . import pipeline

        sections["pipeline"] = pipeline
    for name in SECTIONS + OPTIONAL_SECTIONS:
        if name not in args.only:
            continue
        if cfg["verbose"]:
            print(f"running {name} ...", file=sys.stderr, flush=True)
        results[name] = sections[name].run(cfg)
    scaling = []
    if "dispatch" in results:
        scaling += dispatch.scaling(results["dispatch"])
    if "placement" in results:
        scaling += placement.scaling(results["placement"])
    results["scaling"] = scaling
    results["targets"] = _targets(results)
    results["meta"]["seconds"] = time.perf_counter() - start
    try:
        results["meta"]["loadavg_at_end"] = os.getloadavg()
    except OSError:
        pass

    meta = results["meta"]
    parts = [
        f"`{meta['command']}` on {meta['nproc']} x {meta['cpu']}, {meta['devices']} "
        f"simulated {meta['platform']} devices, jax {meta['jax']}, equinox "
        f"{meta['equinox']}, {meta['date']}, {meta['seconds']:.0f} s; load average "
        f"{_load(meta.get('loadavg_at_start'))} at the start, "
        f"{_load(meta.get('loadavg_at_end'))} at the end. Medians of {cfg['reps']} "
        "interleaved repetitions; ratios are medians of per-round ratios."
    ]
    for name in SECTIONS + OPTIONAL_SECTIONS:
        if name in results:
            parts.append(sections[name].render(results[name]))
        if name == "placement" and scaling:
            parts.append(_render_scaling(scaling))
    parts.append(_render_targets(results["targets"]))
    print("\n\n".join(parts))

    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(results, indent=1, default=str) + "\n")
    if cfg["verbose"]:
        print(f"wrote {json_path}", file=sys.stderr)
    return results
