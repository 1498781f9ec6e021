"""`jax.lax.with_sharding_constraint` under `jax.disable_jit()` does nothing.

Run: python repro.py  (CPU; simulates 8 devices)
"""

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P


jax.config.update("jax_num_cpu_devices", 8)
mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
s = NamedSharding(mesh, P("x"))
x = jnp.arange(8.0)
print(f"jax {jax.__version__}")
print(
    "  jit:         ",
    jax.jit(lambda a: jax.lax.with_sharding_constraint(a, s))(x).sharding,
)
with jax.disable_jit():
    y = jax.lax.with_sharding_constraint(x, s)
    print("  disable_jit: ", y.sharding, "(same object:", y is x, ")")
    z = jax.lax.with_sharding_constraint(
        jnp.arange(10.0), s
    )  # 10 is not divisible by 8
    print("  indivisible under disable_jit raised nothing:", z.shape)
