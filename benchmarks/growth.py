"""Growth over many calls: does `equinox_shard.filter_jit` keep anything per call?

    python benchmarks/growth.py                  # 10,000 calls per scenario
    python benchmarks/growth.py --calls 1000 --json growth.json

Each scenario warms up (compiles, fills caches and allocator pools), then makes
`--calls` calls, and reports:

- the compiled-function cache: the function's traces (counted inside it), its plans and
    compiled entries (`wrapper._table.plans` / `.entries`), and the XLA backend
    compilations during the measured calls (JAX's monitoring events);
- the resident set size (`VmRSS` from /proc/self/status, after `gc.collect()`) at the
    start of the measured calls and after each quarter of them, and its growth in
    total and per call;
- the live JAX arrays (`jax.live_arrays()`) and Python objects (`gc.get_objects()`)
    before and after.

Scenarios, on 8 simulated CPU devices:

- `fresh equal Modules`: every call gets a newly built Module (new arrays, new but equal
    static tuple and string) and a batch; two static signatures, alternating;
    `in_shardings` replicated / batch-sharded and `out_shardings`.
- `x = f(x), donated`: a step function fed its own output, `donate="all"`, starting
    from uncommitted arrays (committed by `filter_jit` before the first call).

Nothing is asserted here; tests/test_concurrency.py checks a shorter run.
"""

import argparse
import gc
import json
import sys
import time


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status (Linux only)")


def _scenarios():
    import equinox as eqx
    import equinox_shard as eqxs
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    replicated = NamedSharding(mesh, P())
    batch_sharding = NamedSharding(mesh, P("data"))
    rng = np.random.default_rng(0)
    host_weight = rng.standard_normal((16, 16), dtype=np.float32)
    host_bias = np.zeros(16, np.float32)
    host_batch = rng.standard_normal((64, 16), dtype=np.float32)

    class Layer(eqx.Module):
        weight: jax.Array
        bias: jax.Array
        config: tuple = eqx.field(static=True)
        name: str = eqx.field(static=True)

        def __call__(self, x):
            return jnp.tanh(x @ self.weight + self.bias[None])

    def fresh_equal_modules():
        traces = []

        @eqxs.filter_jit(
            in_shardings=(replicated, batch_sharding), out_shardings=batch_sharding
        )
        def apply(layer, x):
            traces.append(layer.name)
            return layer(x)

        def call(i):
            layer = Layer(
                jnp.asarray(host_weight),
                jnp.asarray(host_bias),
                ("tanh", 16),
                "".join(["layer", str(i % 2)]),
            )
            return apply(layer, jnp.asarray(host_batch))

        return apply, call, traces, 2

    def donated_loop():
        traces = []

        @eqxs.filter_jit(
            in_shardings=(replicated, batch_sharding),
            out_shardings=(replicated, batch_sharding),
            donate="all",
        )
        def step(params, x):
            traces.append(None)
            return jax.tree.map(lambda p: p * 0.999, params), jnp.tanh(x)

        state = [
            {"w": jnp.asarray(host_weight), "b": jnp.asarray(host_bias)},
            jnp.asarray(host_batch),
        ]

        def call(i):
            state[:] = step(*state)
            return state[1]

        return step, call, traces, 1

    return {
        "fresh equal Modules": fresh_equal_modules,
        "x = f(x), donated": donated_loop,
    }


def run(calls: int, warmup: int) -> dict:
    import jax

    compiles = []

    def listener(event: str, duration_secs: float, **kwargs):
        del duration_secs, kwargs
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    results = {}
    for name, make in _scenarios().items():
        wrapper, call, traces, signatures = make()
        out = None
        for i in range(warmup):
            out = call(i)
        jax.block_until_ready(out)
        gc.collect()
        compiles.clear()
        live_before = len(jax.live_arrays())
        objects_before = len(gc.get_objects())
        rss = [_rss_mib()]
        start = time.perf_counter()
        for i in range(calls):
            out = call(warmup + i)
            if (i + 1) % max(1, calls // 4) == 0:
                jax.block_until_ready(out)
                gc.collect()
                rss.append(_rss_mib())
        jax.block_until_ready(out)
        seconds = time.perf_counter() - start
        del out
        gc.collect()
        table = wrapper._table  # pyright: ignore[reportAttributeAccessIssue]
        results[name] = {
            "calls": calls,
            "seconds": seconds,
            "us_per_call": seconds / calls * 1e6,
            "signatures": signatures,
            "traces": len(traces),
            "plans": len(table.plans),
            "entries": sum(map(len, table.entries.values())),
            "compiles_during_calls": len(compiles),
            "rss_mib": rss,
            "rss_growth_mib": rss[-1] - rss[0],
            "rss_growth_bytes_per_call": (rss[-1] - rss[0]) * 2**20 / calls,
            "live_arrays": [live_before, len(jax.live_arrays())],
            "python_objects": [objects_before, len(gc.get_objects())],
        }
    jax.monitoring.unregister_event_duration_listener(listener)
    return results


def table(results: dict) -> str:
    lines = [
        "| scenario | calls | µs/call | signatures | traces | plans | compiled "
        "entries | compiles (measured) | RSS MiB (start → quarters) | RSS growth | "
        "live arrays | Python objects |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        rss = " → ".join(f"{x:.1f}" for x in r["rss_mib"])
        lines.append(
            f"| {name} | {r['calls']} | {r['us_per_call']:.0f} | {r['signatures']} | "
            f"{r['traces']} | {r['plans']} | {r['entries']} | "
            f"{r['compiles_during_calls']} | {rss} | "
            f"{r['rss_growth_mib']:+.2f} MiB ({r['rss_growth_bytes_per_call']:+.0f} "
            f"B/call) | {r['live_arrays'][0]} → {r['live_arrays'][1]} | "
            f"{r['python_objects'][0]} → {r['python_objects'][1]} |"
        )
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        description="Growth over many calls of equinox_shard.filter_jit."
    )
    parser.add_argument("--calls", type=int, default=10_000)
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)

    import jax

    jax.config.update("jax_num_cpu_devices", 8)  # Before JAX computes anything.
    results = run(args.calls, args.warmup)
    print(f"### Growth over {args.calls} calls (after {args.warmup} warm-up calls)\n")
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
