"""One Python thread launching many small multi-device programs back to back on CPU.

It compares two lists of 54 arrays on 8 simulated CPU devices leaf by leaf, as
`equinox.tree_equal` does (`x == y`, `.all()`, `&`: three small programs per leaf, each
of the reductions with an all-reduce over the 8 devices), 100 times. `NPROC=8` (the
default here) sizes the CPU client's thread pool as on a machine with at most 8 cores:
one thread per device. `NPROC=16 python repro.py` is the workaround.

Run: python repro.py  (CPU; simulates 8 devices). Exits 0 if every round finished, 3 if
the rounds did not finish within 300 s (deadlock); SIGABRT where XLA's rendezvous
termination timeout (40 s) comes first. Busy processes on the cores make it likelier.
"""

import os


os.environ.setdefault("NPROC", "8")  # read when the CPU client is created, below

import threading
import time

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P


jax.config.update("jax_num_cpu_devices", 8)
mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
specs = [P("x", None), P(None, "x"), P()] * 18
xs = [
    jax.device_put(jnp.full((64, 64), i, jnp.float32), NamedSharding(mesh, s))
    for i, s in enumerate(specs)
]
ys = [jnp.copy(x) for x in xs]
done = []


def rounds():
    for _ in range(100):
        ok = jnp.bool_(True)
        for x, y in zip(xs, ys):
            ok = ok & jnp.all(x == y)  # dispatched, not waited for
        assert bool(ok)
        done.append(1)


start = time.time()
thread = threading.Thread(target=rounds, daemon=True)
thread.start()
thread.join(timeout=300)
print(
    f"jax {jax.__version__}: {len(done)} of 100 rounds finished in "
    f"{time.time() - start:.1f} s",
    flush=True,
)
os._exit(0 if len(done) == 100 else 3)
