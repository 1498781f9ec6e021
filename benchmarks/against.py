"""`filter_jit` dispatch of this checkout against another commit's, side by side in one
process: the other commit's `equinox_shard/` is exported with `git archive` and imported
under another name.

    python -m benchmarks.against REF [--reps 11] [--quick] [--inputs | --placement]
                                     [--wall]

`REF` is a git commit, or a folder holding another checkout's `equinox_shard/`.

Prints one row per cell (layout, tree, N, mode): each variant over the `jax.jit` floor,
and this checkout over `REF`, without and with `in_shardings`/`out_shardings`. With
`--inputs`, issue 48's cells instead (`benchmarks.dispatch.run_inputs`: uncommitted,
NumPy and committed inputs, one device and all, with shardings), asynchronous
dispatch: this and `REF` over the flat sketch, and this over `REF`. With
`--placement`, eager `filter_device_put` and `filter_shard` (`benchmarks.placement`'s
cells: uncommitted and placed trees, every layout), each call waited for: this over
`REF`.
"""

import argparse
import importlib
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile


def _export(ref: str, into: pathlib.Path) -> str:
    name = "equinox_shard_at_ref"
    if pathlib.Path(ref, "equinox_shard").is_dir():
        # Another checkout's folder, where there is no git (a device's host).
        shutil.copytree(pathlib.Path(ref, "equinox_shard"), into / name)
    else:
        root = pathlib.Path(__file__).resolve().parent.parent
        archive = subprocess.run(
            ["git", "-C", str(root), "archive", ref, "equinox_shard"],
            check=True,
            capture_output=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
        (into / "equinox_shard").rename(into / name)
    sys.path.insert(0, str(into))
    return name


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.against")
    parser.add_argument(
        "ref",
        help="the git commit (or a folder with its equinox_shard/) to compare against",
    )
    parser.add_argument("--reps", type=int, default=11)
    parser.add_argument("--quick", action="store_true", help="a few cells, 3 rounds")
    parser.add_argument("--inputs", action="store_true", help="issue 48's cells")
    parser.add_argument(
        "--placement", action="store_true", help="filter_device_put, filter_shard"
    )
    parser.add_argument(
        "--wall",
        action="store_true",
        help="time asynchronous dispatch by the wall clock (a host whose thread clock "
        "is too coarse, as an accelerator's may be)",
    )
    args = parser.parse_args()

    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 8)
    import equinox as eqx
    import equinox_shard as new

    from . import _harness as h, _trees as t

    if args.wall:
        h.sample_async = h.sample_async_wall

    with tempfile.TemporaryDirectory() as tmp:
        old = importlib.import_module(_export(args.ref, pathlib.Path(tmp)))
        if args.inputs:
            return _inputs(old, new, h, t, args)
        if args.placement:
            return _placement(old, new, h, t, args)
        ns = [1, 10] if args.quick else [1, 10, 100, 1000]
        layouts = ["batch"] if args.quick else ["replicated", "batch", "single"]
        reps = 3 if args.quick else args.reps
        cells, keep = {}, []
        for layout in layouts:
            s = t.sharding(layout)
            for kind in t.TREES:
                for n in ns:
                    tree = t.place(t.make_tree(kind, n), s)
                    dynamic, static = eqx.partition(tree, eqx.is_array)

                    def floor(d, static=static):
                        out = t.add_one(eqx.combine(d, static))
                        return eqx.partition(out, eqx.is_array)[0]

                    variants = {"floor": (jax.jit(floor), (dynamic,))}
                    for label, pkg in (("ref", old), ("this", new)):
                        plain = pkg.filter_jit(lambda tree: t.add_one(tree))
                        sharded = pkg.filter_jit(
                            lambda tree: t.add_one(tree),
                            in_shardings=s,
                            out_shardings=s,
                        )
                        variants[label] = (plain, (tree,))
                        variants[label + "+shard"] = (sharded, (tree,))
                    keep.append(variants)
                    samplers = {}
                    for name, (fn, fargs) in variants.items():
                        inner = h.calibrate(fn, fargs, 0.003, 200)
                        for mode, sample in (
                            ("async", h.sample_async),
                            ("sync", h.sample_sync),
                        ):
                            samplers[(name, mode)] = (
                                lambda fn=fn, fargs=fargs, inner=inner, sample=sample: (
                                    sample(fn, fargs, inner)
                                )
                            )
                    cells[(layout, kind, n)] = samplers
        measured = h.interleaved(cells, reps=reps, warmup=2, progress=lambda r: None)
    names = ("ref", "this", "ref+shard", "this+shard")
    headers = ["layout", "tree", "N", "mode", "floor µs"]
    headers += [f"{v}/floor" for v in names] + ["this/ref", "this+shard/ref+shard"]
    rows, ratios = [], {"this": [], "this+shard": []}
    for (layout, kind, n), (medians, samples) in measured.items():
        for mode in ("async", "sync"):
            to_floor = h.paired_ratios(
                samples, [(v, mode) for v in names], ("floor", mode)
            )
            row = [layout, kind, str(n), mode, f"{medians[('floor', mode)] * 1e6:.1f}"]
            row += [f"{to_floor[(v, mode)]:.2f}" for v in names]
            for v in ("this", "this+shard"):
                base = v.replace("this", "ref")
                r = h.paired_ratios(samples, [(v, mode)], (base, mode))[(v, mode)]
                ratios[v].append(r)
                row.append(f"{r:.2f}")
            rows.append(row)
    print(h.table(headers, rows))
    for v, values in ratios.items():
        base = v.replace("this", "ref")
        median = statistics.median(values)
        print(
            f"{v} / {base}: median {median:.2f}, worst {max(values):.2f}, "
            f"best {min(values):.2f} over {len(values)} cells"
        )


def _inputs(old, new, h, t, args) -> None:
    import jax

    from .dispatch import _input_sharding, _source, SOURCES
    from .flat_jit import flat_jit

    ns = [1, 10] if args.quick else [1, 10, 100]
    reps = 3 if args.quick else args.reps
    cells, keep = {}, []
    for devices in (1, len(jax.devices())):
        s = _input_sharding(devices)
        for source in SOURCES:
            for kind in t.TREES:
                for n in ns:
                    tree = _source(t.make_tree(kind, n), source, s)
                    variants = {
                        "flat": (flat_jit(lambda x: t.add_one(x), sharding=s), (tree,))
                    }
                    for label, pkg in (("ref", old), ("this", new)):
                        fn = pkg.filter_jit(
                            lambda x: t.add_one(x), in_shardings=s, out_shardings=s
                        )
                        variants[label] = (fn, (tree,))
                    keep.append(variants)
                    samplers = {}
                    for name, (fn, fargs) in variants.items():
                        inner = h.calibrate(fn, fargs, 0.003, 200)
                        samplers[name] = lambda fn=fn, fargs=fargs, inner=inner: (
                            h.sample_async(fn, fargs, inner)
                        )
                    cells[(devices, source, kind, n)] = samplers
    measured = h.interleaved(cells, reps=reps, warmup=2, progress=lambda r: None)
    headers = ["devices", "inputs", "tree", "N", "flat µs", "ref/flat", "this/flat"]
    headers.append("this/ref")
    rows, ratios = [], []
    for (devices, source, kind, n), (medians, samples) in measured.items():
        to_flat = h.paired_ratios(samples, ["ref", "this"], "flat")
        this_ref = h.paired_ratios(samples, ["this"], "ref")["this"]
        ratios.append(this_ref)
        row = [str(devices), source, kind, str(n), f"{medians['flat'] * 1e6:.1f}"]
        row += [f"{to_flat['ref']:.2f}", f"{to_flat['this']:.2f}", f"{this_ref:.2f}"]
        rows.append(row)
    print(h.table(headers, rows))
    print(
        f"this / ref: median {statistics.median(ratios):.2f}, worst {max(ratios):.2f}, "
        f"best {min(ratios):.2f} over {len(ratios)} cells"
    )


def _placement(old, new, h, t, args) -> None:
    ns = [1, 10] if args.quick else [1, 10, 100]
    layouts = ["batch"] if args.quick else list(t.LAYOUTS)
    reps = 3 if args.quick else args.reps
    cells, keep = {}, []
    for layout in layouts:
        s = t.sharding(layout)
        for source in ("uncommitted", "placed"):
            for kind in t.TREES:
                for n in ns:
                    tree = t.make_tree(kind, n)
                    tree = t.place(tree, s) if source == "placed" else tree
                    keep.append(tree)
                    samplers = {}
                    for label, pkg in (("ref", old), ("this", new)):
                        for name, fn in (
                            ("fdp", pkg.filter_device_put),
                            ("fs", pkg.filter_shard),
                        ):
                            fargs = (tree, s)
                            inner = h.calibrate(fn, fargs, 0.003, 200)
                            samplers[(label, name)] = (
                                lambda fn=fn, fargs=fargs, inner=inner: h.sample_sync(
                                    fn, fargs, inner
                                )
                            )
                    cells[(layout, source, kind, n)] = samplers
    measured = h.interleaved(cells, reps=reps, warmup=2, progress=lambda r: None)
    headers = ["layout", "inputs", "tree", "N", "ref fdp µs", "fdp this/ref"]
    headers += ["ref fs µs", "fs this/ref"]
    rows, ratios = [], []
    for (layout, source, kind, n), (medians, samples) in measured.items():
        row = [layout, source, kind, str(n)]
        for name in ("fdp", "fs"):
            r = h.paired_ratios(samples, [("this", name)], ("ref", name))
            ratios.append(r[("this", name)])
            row += [f"{medians[('ref', name)] * 1e6:.1f}", f"{ratios[-1]:.2f}"]
        rows.append(row)
    print(h.table(headers, rows))
    print(
        f"this / ref: median {statistics.median(ratios):.2f}, worst {max(ratios):.2f}, "
        f"best {min(ratios):.2f} over {len(ratios)} cells"
    )


if __name__ == "__main__":
    main()
