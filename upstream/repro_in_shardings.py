# What `filter_jit(in_shardings=)` adds over `filter_shard` at the top of the body.
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P


jax.config.update("jax_num_cpu_devices", 2)
print("jax", jax.__version__)


def run(name, f):
    try:
        print(f"{name}: {f()}")
    except Exception as e:
        print(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:110]}")


for kind in (AxisType.Auto, AxisType.Explicit):
    mesh = jax.make_mesh((2,), ("x",), axis_types=(kind,))
    s, rep = NamedSharding(mesh, P("x")), NamedSharding(mesh, P())
    body = lambda x: x * 2
    kw = eqx.filter_jit(body, in_shardings=s)
    top = eqx.filter_jit(lambda x: body(eqx.filter_shard(x, s)))
    print(f"-- {kind}")
    x = jnp.arange(4.0)  # uncommitted
    for name, f in (("in_shardings", kw), ("filter_shard", top)):
        run(f"{name}, uncommitted: out", lambda: f(x).sharding.spec)
        run(
            f"{name}, AOT: lower(uncommitted), call on P('x')",
            lambda: f.lower(x).compile()(jax.device_put(x, s)).sharding.spec,
        )
        run(
            f"{name}, committed elsewhere",
            lambda: f(jax.device_put(x, rep)).sharding.spec,
        )

        def donate():
            g = eqx.filter_jit(
                f.__wrapped__, donate="warn", **({"in_shardings": s} if f is kw else {})
            )
            y = jax.device_put(jnp.arange(4.0), rep)
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                g(y)
            msgs = [str(m.message)[:45] for m in w]
            return f"input deleted {y.is_deleted()}, warnings {msgs}"

        run(f"{name}, donate committed-replicated", donate)
