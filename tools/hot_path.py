"""Counts the Python work of one cache-hit call of `equinox_shard.filter_jit`: the
Python function calls and bytecodes executed per call, with `sys.settrace`, for a
plain entry, a donating one, one with `in_shardings` (issue 32) and one whose body
has a callback (`eqx.error_if`, issue 41); and of one `filter_device_put` by layout
(replicated, split) and source (uncommitted, placed). Python 3.11: on 3.12 `settrace`
reports no opcodes for some frames. `tests/test_counts.py` pins these counts.

    python tools/hot_path.py           # prints a table
    python tools/hot_path.py --json F  # and writes it

Counted from the wrapper's `__call__` to its return, JAX's own Python included (its
C++ fast path runs no Python). Deterministic: no timing.
"""

import argparse
import json
import os
import sys


os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import equinox as eqx  # noqa: E402
import equinox_shard as eqxs  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402


def _count(fn, *args) -> tuple[int, int, dict]:
    calls = 0
    opcodes = 0
    per_file: dict = {}

    def local(frame, event, arg):
        nonlocal opcodes
        if event == "opcode":
            opcodes += 1
        return local

    def tracer(frame, event, arg):
        nonlocal calls
        if event == "call":
            calls += 1
            name = os.path.basename(frame.f_code.co_filename)
            per_file[name] = per_file.get(name, 0) + 1
            frame.f_trace_opcodes = True
            return local
        return None

    sys.settrace(tracer)
    try:
        out = fn(*args)
    finally:
        sys.settrace(None)
    jax.block_until_ready(out)
    return calls, opcodes, per_file


def _cases():
    model = eqx.nn.MLP(4, 4, 8, 2, key=jax.random.key(0))
    x = jnp.ones((16, 4))
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    replicated = jax.NamedSharding(mesh, jax.P())
    batch = jax.NamedSharding(mesh, jax.P("data"))

    def loss(model, x):
        return jax.vmap(model)(x).sum(), model

    yield "plain", eqxs.filter_jit(loss), lambda: (model, x)
    donating = eqxs.filter_jit(loss, donate="all-except-first")
    yield "donating", donating, lambda: (model, jnp.ones((16, 4)))
    sharded = eqxs.filter_jit(loss, in_shardings=(replicated, batch))
    placed = (eqxs.filter_device_put(model, replicated), jax.device_put(x, batch))
    yield "in_shardings", sharded, lambda: placed

    def checked(model, x):
        out, model = loss(model, x)
        return eqx.error_if(out, jnp.isnan(out), "NaN loss"), model

    yield "callback", eqxs.filter_jit(checked), lambda: (model, x)


def placement_cases():
    """`(name, sharding, make_tree)`: a `filter_device_put` of a tree of 10 arrays,
    by layout and by source."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    for layout, spec in (("replicated", jax.P()), ("split", jax.P("data"))):
        sharding = jax.NamedSharding(mesh, spec)
        uncommitted = [jnp.full((8, 4), i, jnp.float32) for i in range(10)]
        placed = jax.device_put(uncommitted, sharding)
        yield f"{layout} uncommitted", sharding, lambda u=uncommitted: u
        yield f"{layout} placed", sharding, lambda p=placed: p


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--files", action="store_true", help="calls per file")
    options = parser.parse_args()
    rows = {}
    for name, fn, make_args in _cases():
        for _ in range(3):  # compile, then warm
            jax.block_until_ready(fn(*make_args()))
        calls, opcodes, per_file = _count(fn, *make_args())
        rows[name] = {"calls": calls, "bytecodes": opcodes, "per_file": per_file}
    for name, sharding, make_tree in placement_cases():
        put = lambda tree: eqxs.filter_device_put(tree, sharding)
        for _ in range(3):
            jax.block_until_ready(put(make_tree()))
        calls, opcodes, per_file = _count(put, make_tree())
        name = f"filter_device_put {name}"
        rows[name] = {"calls": calls, "bytecodes": opcodes, "per_file": per_file}
    print("| entry | Python calls | bytecodes |")
    print("|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['calls']} | {row['bytecodes']} |")
        if options.files:
            print("   ", row["per_file"])
    if options.json:
        with open(options.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
