"""Eager placement: `jax.lax.with_sharding_constraint` vs `jax.device_put` vs
`equinox_shard.filter_device_put`, outside any trace (RFC.md §1).

    python benchmarks/rfc_eager.py            # the figures quoted in RFC.md
    python benchmarks/rfc_eager.py --quick    # a smoke run (seconds)

Every variant is called on the same input, `--batch` times back to back, and the batch
is waited for (`jax.block_until_ready`) inside the timed region, so asynchronous
dispatch and the copy itself are both counted. Variants are interleaved round by round
(the starting variant rotates) after a warm-up that also compiles whatever the variant
compiles; the table reports the median over `--rounds` rounds, in µs per call, and the
ratio to `jax.device_put` on the same case. A last table times the first call on a
shape never seen before (what compilation costs), one fresh shape per repetition.

Variants (all on 8 simulated CPU devices, one Auto mesh axis `x`):

- `device_put`: `jax.device_put(arrays, sharding)` on the array leaves.
- `wsc`: `jax.lax.with_sharding_constraint(arrays, sharding)` called eagerly.
- `eqx.filter_shard`: Equinox's, which calls `with_sharding_constraint` eagerly.
- `eqxs.filter_device_put`: this package's (one batched `jax.device_put`, and no call
    at all for arrays already carrying an equivalent sharding).
"""

import argparse
import os
import platform
import statistics
import sys
import time


def _setup():
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    return jax


jax = _setup()

import equinox as eqx  # noqa: E402
import equinox_shard as eqxs  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402


VARIANTS = ("device_put", "wsc", "eqx.filter_shard", "eqxs.filter_device_put")


def _mesh():
    return jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))


def _cases(quick: bool):
    """(name, tree, sharding). Trees whose leaves are all arrays, except the Module."""
    mesh = _mesh()
    s = NamedSharding(mesh, P("x"))
    r = NamedSharding(mesh, P())
    big = 1 << (14 if quick else 20)
    small_uncommitted = jnp.arange(64.0)
    big_uncommitted = jnp.arange(float(big))
    ten = [jnp.arange(64.0) + i for i in range(10)]
    mlp = eqx.nn.MLP(64, 64, 256, 2, key=jr.key(0))
    cases = [
        ("f32[64] placed -> same", jax.device_put(small_uncommitted, s), s),
        (f"f32[{big}] placed -> same", jax.device_put(big_uncommitted, s), s),
        ("f32[64] uncommitted -> P('x')", small_uncommitted, s),
        (f"f32[{big}] uncommitted -> P('x')", big_uncommitted, s),
        ("f32[64] numpy -> P('x')", np.arange(64.0, dtype=np.float32), s),
        ("f32[64] P() -> P('x')", jax.device_put(small_uncommitted, r), s),
        ("10 x f32[64] placed -> same", jax.device_put(ten, s), s),
        ("MLP (6 arrays) uncommitted -> P()", mlp, r),
        ("MLP (6 arrays) placed -> same", eqxs.filter_device_put(mlp, r), r),
    ]
    return cases


def _variants(tree, sharding):
    arrays, static = eqx.partition(tree, eqx.is_array)

    def device_put():
        return eqx.combine(jax.device_put(arrays, sharding), static)

    def wsc():
        return eqx.combine(jax.lax.with_sharding_constraint(arrays, sharding), static)

    return {
        "device_put": device_put,
        "wsc": wsc,
        "eqx.filter_shard": lambda: eqx.filter_shard(tree, sharding),
        "eqxs.filter_device_put": lambda: eqxs.filter_device_put(tree, sharding),
    }


def _time_batch(fn, batch: int) -> float:
    outs = []
    start = time.perf_counter()
    for _ in range(batch):
        outs.append(fn())
    jax.block_until_ready(outs)
    return (time.perf_counter() - start) / batch


def _interleaved(variants: dict, *, rounds: int, warmup: int, batch: int) -> dict:
    names = list(variants)
    samples = {name: [] for name in names}
    for k in range(warmup + rounds):
        shift = k % len(names)
        for name in names[shift:] + names[:shift]:
            value = _time_batch(variants[name], batch)
            if k >= warmup:
                samples[name].append(value)
    return {name: statistics.median(v) for name, v in samples.items()}


def _same_object(tree, out) -> str:
    pairs = list(zip(jax.tree.leaves(tree), jax.tree.leaves(out)))
    same = sum(a is b for a, b in pairs if eqx.is_array(a))
    return f"{same}/{sum(eqx.is_array(a) for a, _ in pairs)}"


def _cold(repeats: int) -> dict:
    """First call on a never-seen shape: what each variant compiles, and costs."""
    s = NamedSharding(_mesh(), P("x"))
    samples = {name: [] for name in VARIANTS}
    base = 4096
    for k in range(repeats):
        for j, name in enumerate(VARIANTS):
            # A fresh shape per (repetition, variant): nothing is cached.
            n = 8 * (base + 97 * (k * len(VARIANTS) + j))
            x = jax.block_until_ready(jnp.zeros((n,)))
            fn = _variants(x, s)[name]
            start = time.perf_counter()
            jax.block_until_ready(fn())
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(v) for name, v in samples.items()}


def _fmt_us(seconds: float) -> str:
    us = seconds * 1e6
    return f"{us:,.0f}" if us >= 10 else f"{us:.1f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None)
    args = parser.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 25)
    batch = args.batch or (2 if args.quick else 10)
    warmup = 1 if args.quick else 3
    cold_repeats = 1 if args.quick else 5

    command = "python benchmarks/rfc_eager.py" + (" " + " ".join(sys.argv[1:]))
    print(f"# `{command.strip()}`")
    print(
        f"jax {jax.__version__}, equinox {eqx.__version__}, "
        f"equinox_shard {eqxs.__version__}, {len(jax.devices())} "
        f"{jax.devices()[0].platform} devices, {platform.python_implementation()} "
        f"{platform.python_version()}, {os.cpu_count()} CPUs; median of {rounds} "
        f"interleaved rounds of {batch} calls, µs per call (ratio to device_put)"
    )
    print()
    header = "| case | " + " | ".join(VARIANTS) + " | same object (device_put / eqxs) |"
    print(header)
    print("|---" * (len(VARIANTS) + 2) + "|")
    for name, tree, sharding in _cases(args.quick):
        variants = _variants(tree, sharding)
        medians = _interleaved(variants, rounds=rounds, warmup=warmup, batch=batch)
        floor = medians["device_put"]
        cells = [_fmt_us(floor)] + [
            f"{_fmt_us(medians[v])} ({medians[v] / floor:.1f}x)" for v in VARIANTS[1:]
        ]
        same = (
            f"{_same_object(tree, variants['device_put']())} / "
            f"{_same_object(tree, variants['eqxs.filter_device_put']())}"
        )
        print(f"| {name} | " + " | ".join(cells) + f" | {same} |")
    print()
    print(
        f"First call on a new shape f32[~{8 * 4096}], uncommitted -> P('x') "
        f"(median of {cold_repeats}, ms):"
    )
    print()
    cold = _cold(cold_repeats)
    print("| " + " | ".join(VARIANTS) + " |")
    print("|---" * len(VARIANTS) + "|")
    print("| " + " | ".join(f"{cold[v] * 1e3:.1f}" for v in VARIANTS) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
