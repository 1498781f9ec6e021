# `may_alias=False` onto a split sharding on another set of devices: the result reuses
# `x`'s shard on each device whose slice is the same in both shardings.
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding as S, PartitionSpec as P


jax.config.update("jax_num_cpu_devices", 4)
E = AxisType.Explicit
big = Mesh(np.reshape(jax.devices(), (2, 2)), ("x", "y"), axis_types=(E, E))
small = Mesh(jax.devices()[:2], ("x",), axis_types=(E,))
donate = jax.jit(lambda a: a + 1, donate_argnums=0)
for name, src, dst in [
    (
        "P('x') on devices 0,1 -> P('x') on the 2x2 mesh",
        S(small, P("x")),
        S(big, P("x")),
    ),
    (
        "P('y') on the 2x2 mesh -> P('x') on devices 0,1",
        S(big, P("y")),
        S(small, P("x")),
    ),
    (
        "P('x') on devices 0,1 -> P('y') on the 2x2 mesh",
        S(small, P("x")),
        S(big, P("y")),
    ),
]:
    x = jax.device_put(jnp.arange(4.0), src)
    donate(jax.device_put(x, dst, may_alias=False)).block_until_ready()
    deleted = x.is_deleted()
    print(f"JAX {jax.__version__}: {name}: donating the result deleted x: {deleted}")
