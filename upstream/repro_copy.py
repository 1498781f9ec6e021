# `filter_shard` of an array already on the target sharding: does the result share a
# buffer with the input, and does donating the result delete the input?
import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P


jax.config.update("jax_num_cpu_devices", 2)
for kind in (AxisType.Auto, AxisType.Explicit):
    s = NamedSharding(jax.make_mesh((2,), ("x",), axis_types=(kind,)), P("x"))
    y = jax.device_put(jnp.arange(4.0), s)
    z = eqx.filter_shard(y, s)
    ptr = lambda a: {sh.data.unsafe_buffer_pointer() for sh in a.addressable_shards}  # noqa: E731
    shared = bool(ptr(y) & ptr(z))
    eqx.filter_jit(lambda a: a + 1, donate="all")(z)
    print(
        kind,
        "shares a buffer:",
        shared,
        "| result deleted:",
        z.is_deleted(),
        "input deleted:",
        y.is_deleted(),
    )
