"""A deleted (donated) multi-device array passed again to a compiled function.

Run: python repro.py  (CPU; simulates 8 devices)
"""

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P


jax.config.update("jax_num_cpu_devices", 8)
mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
a = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("x")))
f = jax.jit(lambda u: 2 * u, donate_argnums=0)
compiled = f.lower(a).compile()
compiled(a)
print(
    f"jax {jax.__version__}: a.is_deleted() = {a.is_deleted()}; calling again",
    flush=True,
)
try:
    compiled(a)
except Exception as e:  # expected: a Python error saying the input was deleted
    print("raised:", type(e).__name__, str(e).splitlines()[0], flush=True)
