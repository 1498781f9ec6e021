# PR.md's table: `filter_shard` on a default (`Explicit`) mesh and on a mesh mixing
# `Explicit` and `Auto` axes; run against Equinox v0.13.8 and after 0001.
import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P


jax.config.update("jax_num_cpu_devices", 2)
mesh = jax.make_mesh((2,), ("x",))  # axis_types=(Explicit,), the default
s, x = NamedSharding(mesh, P("x")), jnp.zeros(4)
y = jax.device_put(x, s)
types = (AxisType.Explicit, AxisType.Auto)
mixed = jax.make_mesh((1, 2), ("x", "y"), axis_types=types)
z = jax.device_put(x, NamedSharding(mixed, P("y")))
x2 = jnp.zeros((4, 4))
z2 = jax.device_put(x2, NamedSharding(mixed, P(None, "y")))
free = NamedSharding(mixed, P(None, P.UNCONSTRAINED))
rows = jax.make_mesh((2, 1), ("x", "y"), axis_types=types)
w = jax.device_put(x2, NamedSharding(rows, P("x", None)))
columns = NamedSharding(rows, P(None, "y"))
shard_jit = eqx.filter_jit(eqx.filter_shard)


def in_mesh(f):
    with jax.set_mesh(mesh):
        return f()


cases = {
    "1 eager": lambda: eqx.filter_shard(x, s),
    "2 filter_jit, set_mesh": lambda: in_mesh(lambda: shard_jit(x, s)),
    "3 bare P('x'), set_mesh": lambda: in_mesh(lambda: eqx.filter_shard(x, P("x"))),
    "4 filter_jit, P() of y": lambda: shard_jit(y, NamedSharding(mesh, P())),
    "5 mixed mesh, P() of z": lambda: eqx.filter_shard(z, NamedSharding(mixed, P())),
    "5' ... inside filter_jit": lambda: shard_jit(z, NamedSharding(mixed, P())),
    "6 mixed mesh, P(None, UNCONSTRAINED) of z2": lambda: eqx.filter_shard(z2, free),
    "6' ... inside filter_jit": lambda: shard_jit(z2, free),
    "7 (2, 1) mixed mesh, P(None, 'y') of w": lambda: eqx.filter_shard(w, columns),
    "8 case 7 inside filter_jit": lambda: shard_jit(w, columns),
}
for name, f in cases.items():
    try:
        print(name, f().sharding.spec)
    except Exception as e:
        print(name, type(e).__name__, str(e).splitlines()[0][:90])
