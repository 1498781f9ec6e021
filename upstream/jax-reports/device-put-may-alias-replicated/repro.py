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

for target, name in [(replicated, "replicated"), (jax.devices()[0], "same device")]:
    x = jnp.arange(8.0)  # on device 0, uncommitted
    y = jax.device_put(x, target, may_alias=False)  # documented: always a copy
    donate(y).block_until_ready()
    print(
        f"jax {jax.__version__}, {name}: x deleted after donating its copy:",
        x.is_deleted(),
    )
