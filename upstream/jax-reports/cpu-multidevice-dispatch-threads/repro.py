"""Several Python threads calling multi-device jitted functions at once on CPU.

Run: python repro.py  (CPU; simulates 8 devices). Exits 0 if every call finished, 3 if
the calls did not finish within 60 s (deadlock).
"""

import os
import threading

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P


jax.config.update("jax_num_cpu_devices", 8)
mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
x = jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh, P("x")))
# Four executables, each with a collective (the sum over the sharded axis).
fs = [jax.jit(lambda a, k=k: (a * k).sum()) for k in range(4)]
for f in fs:
    f(x).block_until_ready()
done = []


def worker(t):
    outs = [fs[(t + i) % 4](x) for i in range(1000)]  # dispatched, not waited for
    jax.block_until_ready(outs)
    done.append(1)


threads = [threading.Thread(target=worker, args=(t,), daemon=True) for t in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join(timeout=60)
print(f"jax {jax.__version__}: {len(done)} of 8 threads finished", flush=True)
os._exit(0 if len(done) == 8 else 3)
