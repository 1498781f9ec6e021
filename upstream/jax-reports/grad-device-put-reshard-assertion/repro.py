"""`jax.grad` of `x * reshard(device_put(x, replicated), split)` raises a bare
`AssertionError` when `x` is on no mesh.

Run: python repro.py  (CPU; simulates 2 devices)
"""

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P, reshard


jax.config.update("jax_num_cpu_devices", 2)
mesh = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Explicit,))
split = NamedSharding(mesh, P("x"))
replicated = NamedSharding(mesh, P())
x = jnp.arange(16.0)  # on no mesh


def put_then_reshard(a):
    return reshard(jax.device_put(a, replicated), split)


def put(a):
    return jax.device_put(a, split)


print(f"jax {jax.__version__}")
cases = [
    ("put then reshard, x on no mesh", put_then_reshard, x),
    ("put then reshard, x on no mesh, jax.set_mesh", put_then_reshard, x),
    ("put then reshard, x replicated on the mesh", put_then_reshard, None),
    ("device_put alone, x on no mesh", put, x),
]
for name, move, arg in cases:
    if arg is None:
        arg = jax.device_put(x, replicated)
    f = jax.jit(jax.grad(lambda a: (a * move(a)).sum()))
    try:
        if "set_mesh" in name:
            with jax.set_mesh(mesh):
                g = f(arg)
        else:
            g = f(arg)
        print(f"  {name}: ok, gradient right: {bool((g == 2 * x).all())}")
    except AssertionError as e:
        print(f"  {name}: AssertionError {e}")
