"""`jax.jit(in_shardings=s)` of an array committed to the same devices in another order:
the first call moves it, a later one runs the executable on its buffers as if placed."""

import jax


jax.config.update("jax_num_cpu_devices", 8)
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P


mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
s = NamedSharding(mesh, P("x"))
reverse = Mesh(np.array(jax.devices()[::-1]), ("x",))
placed = jax.device_put(jnp.arange(8.0), NamedSharding(reverse, P("x")))
f = jax.jit(lambda m: m + 1, in_shardings=s)
for i in range(4):
    out = f(placed)
    print("call", i, np.asarray(out)[:3], flush=True)
