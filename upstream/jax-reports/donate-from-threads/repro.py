"""One multi-device array donated to a jitted function from several threads at once.

Run: python repro.py  (CPU; simulates 8 devices)
"""

import threading

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P


jax.config.update("jax_num_cpu_devices", 8)
mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
sharding = NamedSharding(mesh, P("x"))
f = jax.jit(lambda u: 2 * u, donate_argnums=0)
print(f"jax {jax.__version__}: 8 threads donate one array, 20 rounds", flush=True)
errors = []


def call(a, start):
    start.wait()
    try:
        f(a).block_until_ready()
    except Exception as e:  # expected: all but one call raise "Array has been deleted"
        errors.append(type(e).__name__)


for _ in range(20):
    a = jax.device_put(jnp.ones((8, 4)), sharding)
    start = threading.Barrier(8)
    threads = [threading.Thread(target=call, args=(a, start)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
print(f"finished: {len(errors)} calls raised {sorted(set(errors))}", flush=True)
