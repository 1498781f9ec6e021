"""0001 v22 (issue 65): PR.md's "Breaking change" and its fix. Inside
`jax.jit(jax.grad(...))`, `filter_shard` gathering a split array on an `Explicit` mesh:
without `jax.set_mesh`, and under it. Then 1077.md's "JAX needs `jax.set_mesh`": plain
`jax.jit(jax.grad(jnp.sum))` of a split array, no Equinox.

    PYTHONPATH=<Equinox tree> python upstream/repro_breaking.py
"""

import jax


jax.config.update("jax_num_cpu_devices", 2)
import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.sharding as jshard  # noqa: E402


P, NS = jshard.PartitionSpec, jshard.NamedSharding
mesh = jax.make_mesh((2,), ("x",), axis_types=(jshard.AxisType.Explicit,))
replicated, split = NS(mesh, P()), NS(mesh, P("x"))
split_array = jax.device_put(jnp.arange(4.0), split)


def loss(a):
    out = eqx.filter_shard(a, replicated)
    print("  spec inside JIT:", jax.typeof(out).sharding.spec)
    return out.sum()


print("jax", jax.__version__, "equinox", eqx.__file__)
for name, context in (("no jax.set_mesh", None), ("with jax.set_mesh(mesh)", mesh)):
    print(name)
    try:
        if context is None:
            grads = jax.jit(jax.grad(loss))(split_array)
        else:
            with jax.set_mesh(context):
                grads = jax.jit(jax.grad(loss))(split_array)
        print("  grads:", grads.tolist(), grads.sharding.spec)
    except Exception as e:
        print(f"  {type(e).__name__}: {str(e).splitlines()[0][:150]}")

print("plain jax.jit(jax.grad(jnp.sum)), no jax.set_mesh")
try:
    print("  grads:", jax.jit(jax.grad(jnp.sum))(split_array).tolist())
except Exception as e:
    print(f"  {type(e).__name__}: {str(e).splitlines()[0][:150]}")
