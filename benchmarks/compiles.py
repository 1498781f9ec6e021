"""How many times each variant compiles over `calls` calls (counted from JAX's
backend-compile monitoring events, by function name), on a batch-sharded `eqx.Module`
tree of 10 arrays, in three scenarios:

- `fresh values`: every call gets new (uncommitted) arrays of the same shapes;
- `fresh equal Modules`: every call gets a newly built Module whose non-array leaves
    are new objects, equal to the previous ones;
- `x = f(x)`: the output is fed back as the next input, starting from uncommitted
    arrays.

Variants: `eqxs+shard` (`equinox_shard.filter_jit` with in/out shardings), `jit+shard`
(`jax.jit` with in/out shardings on the array partition, the non-array part passed as
a static argument), `eqx` (`equinox.filter_jit`) and `eqxs` (no shardings).
"""

import equinox as eqx
import equinox_shard as eqxs
import jax

from . import _harness as h, _trees as t


VARIANTS = ("eqxs+shard", "jit+shard", "eqx", "eqxs")
SCENARIOS = ("fresh values", "fresh equal Modules", "x = f(x)")
N = 10


def _make(tag: str, s):
    """Fresh functions with unique names, so that their compilations can be counted."""

    def body(tree):
        return t.add_one(tree)

    def on_partition(dynamic, static):
        return eqx.partition(t.add_one(eqx.combine(dynamic, static)), eqx.is_array)[0]

    names = {v: f"bench_compiles_{tag}_{i}" for i, v in enumerate(VARIANTS)}
    fns = {}
    for v in VARIANTS:
        if v == "jit+shard":
            f = lambda dynamic, static: on_partition(dynamic, static)
        else:
            f = lambda tree: body(tree)
        f.__name__ = f.__qualname__ = names[v]
        fns[v] = f
    jitted = jax.jit(
        fns["jit+shard"], static_argnums=1, in_shardings=(s,), out_shardings=s
    )
    callers = {
        "eqxs+shard": eqxs.filter_jit(
            fns["eqxs+shard"], in_shardings=s, out_shardings=s
        ),
        "jit+shard": lambda tree: eqx.combine(
            jitted(*eqx.partition(tree, eqx.is_array)),
            eqx.partition(tree, eqx.is_array)[1],
        ),
        "eqx": eqx.filter_jit(fns["eqx"]),
        "eqxs": eqxs.filter_jit(fns["eqxs"]),
    }
    return callers, names


def run(cfg: dict) -> dict:
    h.start_counting_compiles()
    s = t.sharding("batch")
    calls = cfg["compile_calls"]
    counts: dict = {}
    for k, scenario in enumerate(SCENARIOS):
        callers, names = _make(str(k), s)
        counts[scenario] = {}
        for v in VARIANTS:
            f = callers[v]
            before = h.compiles_of(names[v])
            if scenario == "fresh values":
                for i in range(calls):
                    jax.block_until_ready(f(t.make_tree("module", N, seed=i)))
            elif scenario == "fresh equal Modules":
                for i in range(calls):
                    tree = t.make_tree("module", N, seed=i, fresh_static=True)
                    jax.block_until_ready(f(tree))
            else:
                x = t.make_tree("module", N)
                for _ in range(calls):
                    x = f(x)
                jax.block_until_ready(x)
            counts[scenario][v] = h.compiles_of(names[v]) - before
    return {"variants": list(VARIANTS), "calls": calls, "counts": counts}


def render(result: dict) -> str:
    headers = ["scenario", *VARIANTS]
    rows = [
        [scenario, *(result["counts"][scenario][v] for v in VARIANTS)]
        for scenario in result["counts"]
    ]
    return (
        f"### Compilations over {result['calls']} calls (batch-sharded Module, N={N})"
        "\n\n" + h.table(headers, rows)
    )
