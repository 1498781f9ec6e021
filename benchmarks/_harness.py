"""Timing, memory and compilation-counting utilities shared by the benchmarks.

The machine these run on is usually shared and noisy, so every comparison is made
within one process, with the variants interleaved (each round runs every variant
once, in an order drawn anew each round), after a warm-up, and summarised by the median
of many repetitions. Ratios between variants of the same round are what the tables
report.
"""

import argparse
import collections as co
import datetime
import functools
import gc
import importlib.util
import os
import pathlib
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable

import jax


#
# Timing.
#


def sample_async(
    fn: Callable, args: tuple, inner: int, clock: Callable[[], float] = time.thread_time
) -> float:
    """Seconds of `clock` (by default the calling thread's CPU time) per call, with
    asynchronous dispatch: `inner` calls are issued back to back, and only the last
    output is waited for, outside the timed region."""
    out = None
    start = clock()
    for _ in range(inner):
        out = fn(*args)
    stop = clock()
    jax.block_until_ready(out)
    return (stop - start) / inner


# For an accelerator's host, whose thread CPU clock advances in steps coarser than a
# sample (it read 0 for whole samples on a TPU host).
sample_async_wall = functools.partial(sample_async, clock=time.perf_counter)


def sample_sync(fn: Callable, args: tuple, inner: int) -> float:
    """Wall-clock seconds per call, waiting for each output before the next call."""
    start = time.perf_counter()
    for _ in range(inner):
        jax.block_until_ready(fn(*args))
    stop = time.perf_counter()
    return (stop - start) / inner


def calibrate(fn: Callable, args: tuple, target_s: float, max_inner: int) -> int:
    """How many calls make one sample last about `target_s` seconds. The median of
    five short measurements: one, taken in a burst of load from elsewhere, made some
    cells' samples a single call long for the whole run."""
    jax.block_until_ready(fn(*args))
    per_call = statistics.median(sample_sync(fn, args, 3) for _ in range(5))
    return max(1, min(max_inner, round(target_s / max(per_call, 1e-7))))


def interleaved(
    cells: dict, *, reps: int, warmup: int, progress: Callable[[int], None] = print
) -> dict:
    """Measures many cells (each a dict of samplers to compare), interleaved at two
    levels: every round visits every cell, and within a cell runs each sampler once,
    in an order shuffled every round (seeded, so a run is repeatable). So a burst
    of load from elsewhere spoils a few rounds of every cell, which the medians
    discard, rather than every round of one cell. Shuffled rather than rotated: in
    a rotation each sampler always follows the same one, and one that follows a
    sampler running the same code finds it warm (two instances of one function
    differed by 5-10% that way).

    The objects alive when measuring starts (every cell's trees and compiled
    functions) are moved out of the garbage collector's sight (`gc.freeze`): every
    round allocates the same objects in the same order, so a full collection over
    them would otherwise land in the same sampler round after round.

    Returns, per cell, `(medians, samples)`: the median of the last `reps` samples of
    each sampler, and those samples in round order."""
    samples: dict = {key: {name: [] for name in c} for key, c in cells.items()}
    order = random.Random(0)
    gc.collect()
    gc.freeze()
    try:
        for r in range(warmup + reps):
            for key, samplers in cells.items():
                names = list(samplers)
                order.shuffle(names)
                for name in names:
                    value = samplers[name]()
                    if r >= warmup:
                        samples[key][name].append(value)
            progress(r)
    finally:
        gc.unfreeze()
    return {
        key: ({name: statistics.median(v) for name, v in s.items()}, s)
        for key, s in samples.items()
    }


def progress_printer(what: str, rounds: int, verbose: bool) -> Callable[[int], None]:
    def progress(r: int) -> None:
        if verbose:
            print(f"  {what}: round {r + 1}/{rounds}", file=sys.stderr, flush=True)

    return progress


def paired_ratios(samples: dict, names: list, base) -> dict:
    """For each name, the median over rounds of `sample / base sample` within the same
    round: robust to load that drifts between rounds. Rounds whose base sample is 0 (a
    clock coarser than the sample) are left out; `None` where no round is left."""
    out = {}
    for name in names:
        if name not in samples or base not in samples:
            out[name] = None
            continue
        ratios = [x / y for x, y in zip(samples[name], samples[base]) if y > 0]
        out[name] = statistics.median(ratios) if ratios else None
    return out


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of `ys` against `xs`."""
    mean_x = statistics.fmean(xs)
    mean_y = statistics.fmean(ys)
    num = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys))
    den = sum((x - mean_x) ** 2 for x in xs)
    return num / den


#
# Memory: the peak resident set size of one stretch of work, in one process.
#


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    """Resets the kernel's high-water mark (VmHWM) to the current RSS (Linux >= 4.0).
    Returns whether that worked; otherwise `peak_rss_mib` reports the process's
    lifetime peak."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_mib() -> float:
    kib = _status_kib("VmHWM")
    if kib is None:
        import resource

        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib / 1024


def rss_mib() -> float:
    kib = _status_kib("VmRSS")
    return float("nan") if kib is None else kib / 1024


#
# Compilations, counted per function name from JAX's monitoring events.
#

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compiles: co.Counter = co.Counter()
_listening = False


def _on_event(event: str, duration_secs: float, **kwargs) -> None:
    del duration_secs
    if event == _BACKEND_COMPILE_EVENT:
        _compiles[kwargs.get("fun_name", "?")] += 1


def start_counting_compiles() -> None:
    global _listening
    if not _listening:
        jax.monitoring.register_event_duration_secs_listener(_on_event)
        _listening = True


def compiles_of(name: str) -> int:
    """Backend compilations so far of every function whose name contains `name`."""
    return sum(n for fun_name, n in _compiles.items() if name in fun_name)


#
# The machine.
#


def machine() -> dict:
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    import equinox

    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "loadavg_at_start": load,
        "python": platform.python_version(),
        "jax": jax.__version__,
        "equinox": equinox.__version__,
        "platform": jax.devices()[0].platform,
        "devices": jax.device_count(),
    }


#
# Tables.
#


def fmt(value, kind: str = "us") -> str:
    if value is None:
        return "-"
    if kind == "us":
        return f"{value * 1e6:.1f}" if value < 1e-3 else f"{value * 1e6:.0f}"
    if kind == "x":
        return f"{value:.2f}x"
    if kind == "pct":
        return f"{value * 100:.0f}%"
    return str(value)


def table(headers: list[str], rows: list[list[str]]) -> str:
    """A GitHub-flavoured Markdown table."""
    widths = [
        max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(str(h))
        for i, h in enumerate(headers)
    ]
    line = lambda cells: (
        "| " + " | ".join(str(c).rjust(w) for c, w in zip(cells, widths)) + " |"
    )
    sep = "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"
    return "\n".join([line(headers), sep, *map(line, rows)])


def transformer_example():
    """`examples/train_transformer.py`, imported as a module (it is not a package)."""
    path = pathlib.Path(__file__).parent.parent / "examples" / "train_transformer.py"
    spec = importlib.util.spec_from_file_location("train_transformer", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def standalone_options(description: str, **extra: dict) -> argparse.Namespace:
    """The options of a section run on its own (`python -m benchmarks.NAME`):
    `--quick`, `--device` (JAX's default backend; without it, 8 simulated CPU devices,
    set here before JAX computes anything) and `extra`, `add_argument`'s keyword
    arguments by option name."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--device", action="store_true", help="on JAX's default backend"
    )
    for name, kwargs in extra.items():
        parser.add_argument(f"--{name}", **kwargs)
    options = parser.parse_args()
    if not options.device:
        jax.config.update("jax_num_cpu_devices", 8)
    return options
