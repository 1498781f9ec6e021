"""`jax.device_put(x, replicated, may_alias=False)` shares a single-device `x`'s buffer.

Run: python repro.py  (CPU; simulates 8 devices)
"""

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P


jax.config.update("jax_num_cpu_devices", 8)
mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))
replicated = NamedSharding(mesh, P())
donate = jax.jit(lambda a: a + 1, donate_argnums=0)

cases = [
    ("one device -> replicated", lambda: jnp.arange(8.0), replicated),
    ("one device -> same device", lambda: jnp.arange(8.0), jax.devices()[0]),
    (
        "replicated -> device 7",
        lambda: jax.device_put(jnp.arange(8.0), replicated, may_alias=False),
        jax.devices()[7],
    ),
]
for name, make, target in cases:
    x = make()
    y = jax.device_put(x, target, may_alias=False)  # documented: always a copy
    donate(y).block_until_ready()
    lost = x.is_deleted() or any(s.data.is_deleted() for s in x.addressable_shards)
    print(f"jax {jax.__version__}, {name}: x lost a buffer to its donated copy: {lost}")
