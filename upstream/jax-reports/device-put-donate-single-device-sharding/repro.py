"""`jax.device_put(x, SingleDeviceSharding(d), donate=True)` for `x` on another device.

Run: python repro.py  (CPU; simulates 8 devices)
"""

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding


jax.config.update("jax_num_cpu_devices", 8)
for name, target in [
    ("jax.Device", jax.devices()[2]),
    ("SingleDeviceSharding", SingleDeviceSharding(jax.devices()[2])),
]:
    x = jax.device_put(jnp.arange(64.0), jax.devices()[1])
    y = jax.device_put(x, target, donate=True)
    print(f"jax {jax.__version__}, {name}: y.sum() = {float(y.sum())}", flush=True)
    print(f"  x.is_deleted() = {x.is_deleted()}", flush=True)
    print(f"  x.sum() = {float(x.sum())}", flush=True)  # a crash here is the bug
