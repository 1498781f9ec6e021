# What the wsc-only `filter_shard` does on a default `jax.make_mesh` and under
# `jax.disable_jit`; run against Equinox v0.13.8 and after the series.
import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P


jax.config.update("jax_num_cpu_devices", 2)
print("jax", jax.__version__, "equinox", eqx.__version__)
mesh = jax.make_mesh((2,), ("x",))  # default axis types
print("axis_types", mesh.axis_types)
s = NamedSharding(mesh, P("x"))


def run(name, f):
    try:
        out = f()
        print(f"{name}: {out}")
    except Exception as e:
        print(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:150]}")


x = jnp.zeros(4)
run("1 eager", lambda: eqx.filter_shard(x, s).sharding)


def dj():
    with jax.disable_jit():
        return eqx.filter_shard(x, s).sharding


run("2 disable_jit", dj)


def in_jit():
    with jax.set_mesh(mesh):  # JAX asks for it on Explicit axes inside JIT
        return eqx.filter_jit(eqx.filter_shard)(x, s).sharding


run("3 inside filter_jit", in_jit)
y = jax.device_put(x, s)
run("4 placed returned as itself", lambda: eqx.filter_shard(y, s) is y)


def tg():
    with jax.transfer_guard("disallow"):
        return eqx.filter_shard(y, s).sharding


run("5 placed under transfer_guard('disallow')", tg)


def sm():
    with jax.set_mesh(mesh):
        return eqx.filter_shard(x, P("x")).sharding


run("6 bare P under set_mesh", sm)
auto = jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))


def dj_auto():
    with jax.disable_jit():
        return eqx.filter_shard(x, NamedSharding(auto, P("x"))).sharding


run("7 disable_jit, Auto mesh", dj_auto)
run(
    "8 inside filter_jit, P() of an array split P('x')",
    lambda: eqx.filter_jit(eqx.filter_shard)(y, NamedSharding(mesh, P())).sharding.spec,
)
