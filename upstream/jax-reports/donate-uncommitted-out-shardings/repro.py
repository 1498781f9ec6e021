"""A donated uncommitted input that `jax.jit` moves onto a mesh, with `out_shardings`:
XLA refuses the alias it was told to make.

Run: python repro.py  (CPU; simulates 8 devices)
"""

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P


jax.config.update("jax_num_cpu_devices", 8)
mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
replicated = NamedSharding(mesh, P())
a = jnp.arange(8.0)  # uncommitted, on device 0
b = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("x")))
f = jax.jit(lambda a, b: a * b, out_shardings=replicated, donate_argnums=(0, 1))
print(f"jax {jax.__version__}: f(donate(a uncommitted), donate(b split))", flush=True)
try:
    out = f(a, b)
except Exception as e:
    print(f"{type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
    print("a deleted:", a.is_deleted(), "b deleted:", b.is_deleted(), flush=True)
    raise SystemExit(1)
print("result:", float(out.sum()), out.sharding, flush=True)
