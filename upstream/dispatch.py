"""`filter_jit` dispatch and eager `filter_shard` per call, for Equinox trees patched
to different points of the series: one process per version, the versions alternating.

    python upstream/dispatch.py ROUNDS NUMBER REPEAT base=/eqx/at/v0.13.8 p1=... p2=...

Each `NAME=DIR` is a folder holding an `equinox/` package, put first on `PYTHONPATH`.
Times are the process's CPU time (all its threads) per call, so that other jobs on a
shared machine slow the run down without adding to what is measured. Each case also
reports how many Python function calls and bytecode instructions one dispatch runs
(`sys.settrace`), which does not depend on the machine at all.
"""

import json
import os
import statistics
import subprocess
import sys
import time
import timeit


def worker(number: int, repeat: int) -> None:
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import jax.random as jr

    jax.config.update("jax_num_cpu_devices", 2)

    class Flat(eqx.Module):
        a0: jax.Array
        a1: jax.Array
        a2: jax.Array
        a3: jax.Array
        a4: jax.Array
        a5: jax.Array
        a6: jax.Array
        a7: jax.Array
        a8: jax.Array
        a9: jax.Array

    key, x = jr.PRNGKey(0), jnp.ones(4)
    call = eqx.filter_jit(lambda m, x: m(x))
    cases = {
        "small MLP": (call, (eqx.nn.MLP(4, 4, 8, 2, key=key), x)),
        "depth-8 MLP": (call, (eqx.nn.MLP(4, 4, 8, 8, key=key), x)),
        "flat 10-array Module": (
            eqx.filter_jit(lambda m, x: m.a0 + x),
            (Flat(*[jnp.ones(4)] * 10), x),
        ),
        "one array": (eqx.filter_jit(lambda x: x + 1), (x,)),
    }
    # Eager placement of an unplaced MLP: what 0001 changes.
    mesh = jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    cases["eager filter_shard, small MLP"] = (
        eqx.filter_shard,
        (cases["small MLP"][1][0], rep),
    )
    if "in_shardings" in (eqx.filter_jit.__doc__ or ""):
        s = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        f = eqx.filter_jit(lambda m, x: m(x), in_shardings=s)
        cases["small MLP, in_shardings given"] = (f, cases["small MLP"][1])
    out = {}
    for name, (f, args) in cases.items():
        for _ in range(50):
            f(*args)
        call = lambda: f(*args)  # noqa: E731
        cpu = time.process_time
        times = timeit.repeat(call, timer=cpu, number=number, repeat=repeat)
        out[name] = [t / number * 1e6 for t in times]
        calls, opcodes = python_work(call)
        out[name + " (Python calls)"] = [float(calls)]
        out[name + " (bytecodes)"] = [float(opcodes)]
    print(json.dumps(out))


def python_work(fn) -> tuple[int, int]:
    """Python function calls and bytecode instructions that one call of `fn` runs."""
    calls = opcodes = 0

    def trace(frame, event, arg):
        nonlocal calls, opcodes
        if event == "call":
            calls += 1
            frame.f_trace_opcodes = True
        elif event == "opcode":
            opcodes += 1
        return trace

    sys.settrace(trace)
    try:
        fn()
    finally:
        sys.settrace(None)
    return calls, opcodes


def main() -> None:
    rounds, number, repeat = sys.argv[1:4]
    versions = dict(v.split("=", 1) for v in sys.argv[4:])
    names = list(versions)
    times: dict[str, dict[str, list[float]]] = {}
    for r in range(int(rounds)):
        for name in names if r % 2 == 0 else names[::-1]:
            env = dict(os.environ, PYTHONPATH=versions[name])
            cmd = [sys.executable, __file__, "--worker", number, repeat]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True)
            for case, ts in json.loads(out.stdout.splitlines()[-1]).items():
                times.setdefault(case, {}).setdefault(name, []).extend(ts)
    print("| case | version | best µs | median µs | IQR µs | best/base | median/base |")
    print("|---|---|---|---|---|---|---|")
    for case, by in times.items():
        base = by.get(names[0])
        for name, ts in by.items():
            q1, _, q3 = statistics.quantiles(ts, n=4) if len(ts) > 1 else ts * 3
            best, median = min(ts), statistics.median(ts)
            ratios = "| |"
            if base:
                best_ratio = best / min(base)
                median_ratio = median / statistics.median(base)
                ratios = f"| {best_ratio:.3f} | {median_ratio:.3f} |"
            row = f"| {case} | {name} | {best:.1f} | {median:.1f} | {q1:.1f}–{q3:.1f} "
            print(row + ratios)


if __name__ == "__main__":
    if sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), int(sys.argv[3]))
    else:
        main()
