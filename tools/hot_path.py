"""Counts the Python work of one cache-hit call of `equinox_shard.filter_jit`: the
Python function calls and bytecodes executed per call, with `sys.settrace`, for a
plain entry, a donating one, one with `in_shardings` (issue 32; its inputs placed,
uncommitted, and a NumPy batch: issue 48) and one whose body has a callback
(`eqx.error_if`, issue 41); and of one `filter_device_put` by layout
(replicated, split) and source (uncommitted, placed). Python 3.11: on 3.12 `settrace`
reports no opcodes for some frames. `tests/test_counts.py` pins these counts.

    python tools/hot_path.py             # prints a table
    python tools/hot_path.py --json F    # and writes it
    python tools/hot_path.py --boundary  # JAX's Python counted at its boundary only

Counted from the wrapper's `__call__` to its return, JAX's own Python included (its
C++ fast path runs no Python), or with `--boundary` only each call into JAX from
other code (JAX's internal caches make the work within it vary with what ran before
in the process). Deterministic: no timing.
"""

import argparse
import functools as ft
import itertools
import json
import os
import sys


os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import equinox as eqx  # noqa: E402
import equinox_shard as eqxs  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from equinox_shard._jit import launch  # noqa: E402


_JAX = tuple(os.path.dirname(str(m.__file__)) + os.sep for m in (jax, jax.lib))
# Runtime type checkers (the tests run under jaxtyping and beartype): transparent.
_CHECKERS = (
    "<@beartype",
    *(f"{os.sep}{name}{os.sep}" for name in ("beartype", "jaxtyping")),
)
_OURS = os.path.dirname(str(eqxs.__file__)) + os.sep


def _is_checker(name: str) -> bool:
    return name.startswith(_CHECKERS[0]) or any(c in name for c in _CHECKERS[1:])


def _within(frame, jax_inside: bool) -> bool:
    """Whether code that `frame` calls runs for a type checker or, unless
    `jax_inside`, for JAX: such a frame comes before one of ours on the way up."""
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_OURS):
            return False
        if _is_checker(name) or (not jax_inside and name.startswith(_JAX)):
            return True
        frame = frame.f_back
    return False


def _count(fn, *args, jax_inside: bool = True) -> tuple[int, int, dict]:
    """`(calls, bytecodes, calls per file)` of `fn(*args)`, not counting the work of
    a runtime type checker. With `jax_inside=False`, JAX's own Python is counted at
    its boundary only: each call into JAX from other code, none within it and none of
    its bytecodes (JAX's internal caches make its work vary with what ran before in
    the process)."""
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
            name = frame.f_code.co_filename
            if _is_checker(name) or (
                not name.startswith(_OURS) and _within(frame.f_back, jax_inside)
            ):
                return None
            in_jax = not jax_inside and name.startswith(_JAX)
            calls += 1
            name = os.path.basename(name)
            per_file[name] = per_file.get(name, 0) + 1
            if in_jax:
                return None
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
    # As users pass them (issue 48): a model never placed with a fresh batch, and a
    # placed model with a NumPy batch; `jax.jit` moves both itself.
    # A function each (wrappers of one function share a cache, whose last call's
    # entry step 0 tries): each case counts on its own, whatever ran before.
    fresh = eqxs.filter_jit(ft.partial(loss), in_shardings=(replicated, batch))
    yield "in_shardings uncommitted", fresh, lambda: (model, jnp.ones((16, 4)))
    host = np.ones((16, 4), np.float32)
    numpy = eqxs.filter_jit(ft.partial(loss), in_shardings=(replicated, batch))
    yield "in_shardings numpy", numpy, lambda: (placed[0], host.copy())

    # A many-device program run on one device, its batch put on that device (a
    # `SingleDeviceSharding`, which `jax.jit` takes for the mesh's sharding), donating.
    one = jax.make_mesh(
        (1,),
        ("data",),
        axis_types=(jax.sharding.AxisType.Auto,),
        devices=jax.devices()[:1],
    )
    step = eqxs.filter_jit(
        loss,
        in_shardings=(
            jax.NamedSharding(one, jax.P()),
            jax.NamedSharding(one, jax.P("data")),
        ),
        donate="all-except-first",
    )
    on_one = eqxs.filter_device_put(model, jax.NamedSharding(one, jax.P()))
    device = jax.devices()[0]
    yield (
        "one device, batch on it",
        step,
        lambda: (on_one, jax.device_put(host, device)),
    )
    # Issue 62's one-device cells: inputs on their targets, and as `jnp` made them.
    one_shardings = (jax.NamedSharding(one, jax.P()), jax.NamedSharding(one, jax.P()))
    on_one_step = eqxs.filter_jit(loss, in_shardings=one_shardings)
    on_one_x = jax.device_put(x, one_shardings[1])
    yield "one device, placed", on_one_step, lambda: (on_one, on_one_x)
    yield "one device, uncommitted", on_one_step, lambda: (model, x)
    yield "one device, placed model, fresh batch", on_one_step, lambda: (on_one, x)

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


def cases():
    """`(name, fn, make_args)` for every counted call, compiled and warm."""
    for name, fn, make_args in _cases():
        for _ in range(3):  # compile, then warm
            jax.block_until_ready(fn(*make_args()))
        yield name, fn, make_args
    for name, sharding, make_tree in placement_cases():
        put = lambda tree, sharding=sharding: eqxs.filter_device_put(tree, sharding)
        for _ in range(3):
            jax.block_until_ready(put(make_tree()))
        yield f"filter_device_put {name}", put, lambda m=make_tree: (m(),)


def count(fn, make_args, *, jax_inside: bool = True) -> tuple[int, int, dict]:
    """`_count` of a warm call, the second of two: on Python 3.12+ the first call
    traced with `f_trace_opcodes` reports fewer opcodes. Neither is a paced launch
    (`equinox_shard._jit.launch.PACE`), whose wait would count whatever ran before."""
    launch.launches = itertools.count(1)
    _count(fn, *make_args(), jax_inside=jax_inside)
    launch.launches = itertools.count(1)
    return _count(fn, *make_args(), jax_inside=jax_inside)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--files", action="store_true", help="calls per file")
    parser.add_argument(
        "--boundary",
        action="store_true",
        help="count JAX's Python at its boundary only (as tests/test_counts.py does)",
    )
    options = parser.parse_args()
    rows = {}
    for name, fn, make_args in cases():
        calls, opcodes, per_file = count(fn, make_args, jax_inside=not options.boundary)
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
