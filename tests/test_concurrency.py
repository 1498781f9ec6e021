"""`filter_jit` called from many threads at once, and many times over.

- Threads: 8 threads call one `filter_jit`-wrapped function 1000 times each, with a
    static argument that takes 4 values (so threads share compiled functions, and race
    to compile each one first). Nothing may raise, every output must be right, and the
    function must be traced exactly once per static value. These run in a fresh process
    with a deadline, because a deadlock would otherwise hang the test run (see
    `test_threads_sharded`).
- Growth: thousands of calls with freshly built but equal Modules must not add compiled
    functions (nor compile anything) past the first call per static signature, and must
    not grow the resident memory. benchmarks/growth.py measures the same at 10,000
    calls and reports the figures.
"""

import gc
import os
import subprocess
import sys

import equinox as eqx
import equinox_shard as eqxs
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from .helpers import auto_mesh, count_compiles
from .isolated import run_isolated


_THREADS = """
import collections
import threading

import equinox_shard as eqxs
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P, make_single_device_sharding

THREADS, CALLS, STATICS = 8, {calls}, 4
if {sharded}:
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = NamedSharding(mesh, P("x"))
else:
    sharding = make_single_device_sharding(jax.devices()[0])

traces = collections.Counter()
traces_lock = threading.Lock()


@eqxs.filter_jit(in_shardings=(sharding, None), out_shardings=sharding)
def f(x, k):
    with traces_lock:
        traces[k] += 1
    return x * k + 1


base = np.arange(8.0, dtype=np.float32)
committed = jax.device_put(base, sharding)
barrier = threading.Barrier(THREADS)
errors = []
outputs = [[] for _ in range(THREADS)]


def work(t):
    try:
        barrier.wait()  # All threads start together: they race to compile.
        for i in range(CALLS):
            k = (t + i) % STATICS
            # Uncommitted inputs first (committed to `sharding` before the call), then
            # committed ones: both must use the same compilation.
            x = jnp.asarray(base) if i < STATICS else committed
            outputs[t].append((k, f(x, k)))
    except BaseException as e:
        errors.append(repr(e))


threads = [threading.Thread(target=work, args=(t,)) for t in range(THREADS)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()

wrong = 0
for t in range(THREADS):
    for k, out in outputs[t]:
        if not (
            np.array_equal(np.asarray(out), base * k + 1)
            and out.sharding.is_equivalent_to(sharding, 1)
        ):
            wrong += 1
report(
    {{
        "errors": errors[:5],
        "calls": sum(map(len, outputs)),
        "wrong": wrong,
        "traces": {{str(k): n for k, n in traces.items()}},
        "plans": len(f._cache.structures),
        "entries": sum(map(len, f._cache.entries.values())),
    }}
)
"""


def _check_threads(run, calls):
    assert run.returncode == 0, run
    result = run.result
    assert result["errors"] == [], result
    assert result["calls"] == 8 * calls, result
    assert result["wrong"] == 0, result
    # Traced once per static value, however many threads raced for it.
    assert result["traces"] == {"0": 1, "1": 1, "2": 1, "3": 1}, result
    assert result["plans"] == 1, result
    assert result["entries"] == 4, result


@pytest.mark.slow
def test_threads():
    calls = 1000
    run = run_isolated(_THREADS.format(sharded=False, calls=calls), timeout=300)
    _check_threads(run, calls)


@pytest.mark.slow
def test_threads_sharded():
    calls = 1000
    # A deadlocked run is killed at the deadline (a good run takes seconds).
    run = run_isolated(_THREADS.format(sharded=True, calls=calls), timeout=90)
    _check_threads(run, calls)


# One thread compares two lists of 54 arrays on 8 devices, leaf by leaf, 100 times:
# thousands of small 8-device calls with an all-reduce, launched back to back while busy
# processes compete for every core. JAX 0.10.2's CPU client queues at most 32 programs
# per device and waits for a free slot on a thread of its pool, which has one thread per
# device where the machine has at most 8 cores (`NPROC` says how many it counts): one
# launch waiting there, and the all-reduce queued before it never gets its 8th
# participant; XLA aborts the process after 40 s (SIGABRT;
# upstream/jax-reports/cpu-inflight-limit-deadlock). `filter_jit` waits for every
# `_jit.launch.PACE`-th launch on several CPU devices, so they never queue that deep.
_BACK_TO_BACK = """
import os

os.environ["NPROC"] = "8"  # before the CPU client exists: one pool thread per device

import equinox_shard as eqxs
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
replicated = NamedSharding(mesh, P())
specs = [P("x", None), P(None, "x"), P()] * 18
xs = [
    jax.device_put(jnp.full((64, 64), i, jnp.float32), NamedSharding(mesh, s))
    for i, s in enumerate(specs)
]
ys = [jnp.copy(x) for x in xs]
same = eqxs.filter_jit(lambda a, b: jnp.all(a == b), out_shardings=replicated)
both = eqxs.filter_jit(lambda a, b: a & b, out_shardings=replicated)
rounds = []
for _ in range(100):
    ok = same(xs[0], ys[0])
    for x, y in zip(xs, ys):
        ok = both(ok, same(x, y))
    rounds.append(bool(ok))
report(rounds)
"""


@pytest.mark.slow
def test_many_calls_back_to_back_under_load():
    busy = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(os.cpu_count() or 2)
    ]
    try:
        run = run_isolated(_BACK_TO_BACK, timeout=600)
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    assert run.returncode == 0, run
    assert run.result == [True] * 100, run


# One array donated from 8 threads at once, to one function or to two: the first call
# to dispatch donates it, every other raises the named error. JAX 0.10.2 crashes
# (SIGSEGV) when a thread dispatches an input that another donated after it was checked.
_DONATED_FROM_THREADS = """
import itertools
import threading

import equinox_shard as eqxs
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

THREADS, ROUNDS = 8, 3
mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
batch = NamedSharding(mesh, P("x"))
runs = []
for _, donate, functions, warm in itertools.product(
    range(ROUNDS), ["all", "warn"], [1, 2], [False, True]
):
    # Fresh decorations: when not warm, the threads race to compile them too.
    fs = [
        eqxs.filter_jit(lambda v: v * 2, in_shardings=batch, donate=donate)
        for _ in range(functions)
    ]
    if warm:
        for f in fs:
            f(jax.device_put(jnp.arange(16.0), batch))
    v = jax.device_put(jnp.arange(16.0), batch)
    barrier = threading.Barrier(THREADS)
    outputs, errors = [], []

    def work(t):
        barrier.wait()
        try:
            outputs.append(np.asarray(fs[t % functions](v)))
        except RuntimeError as e:
            errors.append(str(e))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    runs.append(
        {
            "outputs": len(outputs),
            "right": all(np.array_equal(o, np.arange(16.0) * 2) for o in outputs),
            "errors": sorted(set(errors)),
            "deleted": v.is_deleted(),
        }
    )
report(runs)
"""


def test_same_array_donated_from_threads():
    run = run_isolated(_DONATED_FROM_THREADS, timeout=300)
    assert run.returncode == 0, run
    assert len(run.result) == 3 * 2 * 2 * 2, run
    message = "v: this array has been deleted (was it donated to an earlier call?)."
    for result in run.result:
        assert result["outputs"] == 1, run
        assert result["right"], run
        assert result["errors"] == [message], run
        assert result["deleted"], run


# One array donated by one thread's call and passed to another's that donates nothing,
# on 8 devices: the other call looked for deleted inputs before taking the launch lock,
# so it could launch one donated since (SIGSEGV on JAX 0.10.2, as with `jax.jit`).
_DONATED_WHILE_ANOTHER_THREAD_READS = """
import threading

import equinox_shard as eqxs
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
s = NamedSharding(mesh, P())
donating = eqxs.filter_jit(lambda k, b: (k.sum() + b, b * 2), donate="all-except-first")
reading = eqxs.filter_jit(lambda b: b * 5)
keep = jax.device_put(jnp.arange(8.0), s)
shared = [jax.device_put(jnp.full(8, float(i)), s) for i in range(200)]
barrier = threading.Barrier(2)
errors = set()


def work(call):
    for b in shared:
        barrier.wait()
        try:
            call(b)
        except RuntimeError as e:
            errors.add(str(e))


threads = [
    threading.Thread(target=work, args=(call,))
    for call in (lambda b: donating(keep, b), reading)
]
for t in threads:
    t.start()
for t in threads:
    t.join()
report(dict(errors=sorted(errors), keep=keep.tolist()))
"""


def test_array_donated_while_another_thread_reads_it():
    run = run_isolated(_DONATED_WHILE_ANOTHER_THREAD_READS, timeout=300)
    assert run.returncode == 0, run
    deleted = "b: this array has been deleted (was it donated to an earlier call?)."
    assert run.result["errors"] == [deleted], run
    assert run.result["keep"] == list(range(8)), run


# The same with an eager placement reading the array: `filter_shard`, and
# `filter_device_put` onto other devices, placed before they took the launch lock, so
# they could move an array donated meanwhile (JAX's unnamed "Buffer has been deleted or
# donated", or a SIGSEGV); and `filter_jit`'s own move of a committed input.
_DONATED_WHILE_ANOTHER_THREAD_PLACES = """
import threading

import equinox_shard as eqxs
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
s = NamedSharding(mesh, P())
rows = NamedSharding(mesh, P("x"))
donating = eqxs.filter_jit(lambda k, b: (k.sum() + b, b * 2), donate="all-except-first")
moving = eqxs.filter_jit(lambda b: b * 5, in_shardings=rows)
readers = {
    "filter_shard": lambda b: eqxs.filter_shard({"w": b}, rows),
    "filter_device_put": lambda b: eqxs.filter_device_put({"w": b}, rows),
    "filter_device_put onto one device": lambda b: eqxs.filter_device_put(
        {"w": b}, jax.devices()[3]
    ),
    "filter_jit moving it": moving,
}
keep = jax.device_put(jnp.arange(8.0), s)
results = {}
for name, reading in readers.items():
    shared = [jax.device_put(jnp.full(8, float(i)), s) for i in range(200)]
    barrier = threading.Barrier(2)
    errors = set()

    def work(call):
        for b in shared:
            barrier.wait()
            try:
                jax.block_until_ready(call(b))
            except RuntimeError as e:
                errors.add(str(e))

    threads = [
        threading.Thread(target=work, args=(call,))
        for call in (lambda b: donating(keep, b), reading)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results[name] = sorted(errors)
    print(name, flush=True)  # the last line before a crash names its reader
report(dict(results=results, keep=keep.tolist()))
"""


def test_array_donated_while_another_thread_places_it():
    run = run_isolated(_DONATED_WHILE_ANOTHER_THREAD_PLACES, timeout=300)
    assert run.returncode == 0, run
    deleted = "this array has been deleted (was it donated to an earlier call?)"
    assert run.result["results"] == {
        "filter_shard": [f"x['w']: {deleted}, so it cannot be placed."],
        "filter_device_put": [f"x['w']: {deleted}, so it cannot be placed."],
        "filter_device_put onto one device": [
            f"x['w']: {deleted}, so it cannot be placed."
        ],
        "filter_jit moving it": [f"b: {deleted}."],
    }, run
    assert run.result["keep"] == list(range(8)), run


# The same with a callback in the body (`eqx.error_if`), through the wrapper and through
# its `Compiled`: the callback's wait stacks on the donating dispatch (its lock and its
# re-check), it does not replace it. It crashed the process (SIGSEGV).
_DONATED_TO_CALLBACK_FROM_THREADS = """
import threading

import equinox as eqx
import equinox_shard as eqxs
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

THREADS, ROUNDS = 4, 3
mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
s = NamedSharding(mesh, P("x"))
runs = []
for aot in [False, True]:
    f = eqxs.filter_jit(
        lambda a: eqx.error_if(a, jnp.any(a < -1), "neg") + 1,
        in_shardings=s,
        out_shardings=s,
        donate="all",
    )
    if aot:
        f = f.lower(jax.ShapeDtypeStruct((16,), jnp.float32, sharding=s)).compile()
    for _ in range(ROUNDS):
        v = eqxs.filter_device_put(jnp.arange(16.0), s)
        barrier = threading.Barrier(THREADS)
        outputs, errors = [], []

        def work():
            barrier.wait()
            try:
                outputs.append(np.array(f(v)))
            except RuntimeError as e:
                errors.append(str(e))

        threads = [threading.Thread(target=work) for _ in range(THREADS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        runs.append(
            {
                "outputs": len(outputs),
                "right": all(np.array_equal(o, np.arange(16.0) + 1) for o in outputs),
                "errors": len(errors),
                "named": all("a: this array has been deleted" in e for e in errors),
                "deleted": v.is_deleted(),
            }
        )
report(runs)
"""


def test_same_array_donated_to_a_callback_from_threads():
    run = run_isolated(_DONATED_TO_CALLBACK_FROM_THREADS, timeout=300)
    assert run.returncode == 0, run
    assert len(run.result) == 2 * 3, run
    for result in run.result:
        assert result["outputs"] == 1, run
        assert result["right"] and result["named"] and result["deleted"], run
        assert result["errors"] == 3, run


# Under `jax.disable_jit()`, a compiled entry runs the function itself, under the
# dispatch lock; the function calls another `filter_jit`, which takes the lock again.
_NESTED_UNDER_DISABLE_JIT = """
import equinox_shard as eqxs
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
batch = NamedSharding(mesh, P("x"))
results = []
for donate in ["none", "all"]:
    inner = eqxs.filter_jit(lambda v: v * 2, in_shardings=batch, donate=donate)
    outer = eqxs.filter_jit(lambda v: inner(v) + 1, in_shardings=batch, donate=donate)
    outer(jax.device_put(jnp.arange(16.0), batch))  # compiles the entry
    with jax.disable_jit():
        out = outer(jax.device_put(jnp.arange(16.0), batch))
    results.append(np.asarray(out).tolist())
report(results)
"""


def test_nested_call_under_disable_jit():
    run = run_isolated(_NESTED_UNDER_DISABLE_JIT, timeout=60)
    assert run.returncode == 0, run
    expected = (np.arange(16.0) * 2 + 1).tolist()
    assert run.result == [expected, expected], run


#
# Growth.
#


class _Layer(eqx.Module):
    weight: jax.Array
    bias: jax.Array
    activation: tuple = eqx.field(static=True)
    name: str = eqx.field(static=True)

    def __call__(self, x):
        return jnp.tanh(x @ self.weight + self.bias[None])


def _fresh_layer(i: int) -> _Layer:
    # New arrays, new tuple, new string: equal to, but not the same objects as, those
    # of the previous call. Two static signatures (`name`).
    rng = np.random.default_rng(0)
    weight = jnp.asarray(rng.standard_normal((4, 4), dtype=np.float32))
    bias = jnp.asarray(np.zeros(4, np.float32))
    return _Layer(weight, bias, ("tanh", 4), "".join(["layer", str(i % 2)]))


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")  # pragma: no cover


# RSS may grow by at most this much over the measured calls (it measures well under
# 1 MiB for 10,000 calls: see benchmarks/growth.py); a leak of one compiled function,
# trace or PyTree per call would exceed it.
_RSS_BOUND_MIB = 32


@pytest.mark.slow
def test_growth_fresh_equal_modules():
    mesh = auto_mesh()
    replicated = NamedSharding(mesh, P())
    batch = NamedSharding(mesh, P("x"))
    traces = []

    @eqxs.filter_jit(in_shardings=(replicated, batch), out_shardings=batch)
    def apply(layer, x):
        traces.append(layer.name)
        return layer(x)

    x = jax.device_put(jnp.ones((8, 4)), batch)
    expected: dict[str, np.ndarray] = {}
    for i in range(200):  # warm-up: compiles, caches, allocator pools
        layer = _fresh_layer(i)
        expected[layer.name] = np.asarray(layer(jnp.ones((8, 4))))
        jax.block_until_ready(apply(layer, x))
    assert sorted(traces) == ["layer0", "layer1"]
    gc.collect()
    before = _rss_mib()
    out = None
    with count_compiles() as compiles:
        for i in range(3000):
            out = apply(_fresh_layer(i), x)
            if i % 500 == 0:
                np.testing.assert_allclose(out, expected[f"layer{i % 2}"], rtol=1e-6)
                assert out.sharding.is_equivalent_to(batch, 2)
        jax.block_until_ready(out)
    gc.collect()
    growth = _rss_mib() - before
    assert compiles == []
    assert sorted(traces) == ["layer0", "layer1"]
    assert len(apply._cache.structures) == 2
    entries = apply._cache.entries.values()
    assert sum(map(len, entries)) == 2
    assert growth < _RSS_BOUND_MIB, growth
