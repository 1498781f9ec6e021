"""One multi-device buffer passed twice to a jitted call, donated in one position.

Run: python repro.py  (CPU; simulates 8 devices)
"""

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P


jax.config.update("jax_num_cpu_devices", 8)
mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
a = jax.device_put(jnp.arange(64.0), NamedSharding(mesh, P("x")))
print(f"jax {jax.__version__}: calling f(donate(a), a)", flush=True)
out = jax.jit(lambda u, v: u + v, donate_argnums=0)(a, a)
print("result:", float(out.sum()), flush=True)
