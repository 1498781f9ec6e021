"""A `pure_callback` that raises inside a program partitioned over several devices.

This is what `equinox.error_if` does when its check fails. Run: python repro.py
(CPU; simulates 8 devices). Expected: a Python exception. Observed: the other
partitions wait in a collective for the one whose callback failed, until XLA's
rendezvous timeout aborts the process (about 40 s).
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P


jax.config.update("jax_num_cpu_devices", 8)
mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))


def fails(x):
    raise ValueError("checked at runtime: x is positive")


@jax.jit
def f(x):
    bad = jnp.any(x > 0)  # an all-reduce over the 8 devices
    y = jax.lax.cond(
        bad,
        lambda: jax.pure_callback(fails, jax.ShapeDtypeStruct((), np.float32), bad),
        lambda: jnp.float32(0),
    )
    return x + y  # the callback's result is broadcast to every device


x = jax.device_put(jnp.ones(8), NamedSharding(mesh, P("x")))
start = time.time()
print(f"jax {jax.__version__}: calling", flush=True)
try:
    f(x).block_until_ready()
except Exception as e:
    print(f"raised after {time.time() - start:.1f} s:", type(e).__name__, flush=True)
