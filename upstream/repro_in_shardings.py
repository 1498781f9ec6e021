# What `filter_jit(in_shardings=, out_shardings=)` would add over `filter_shard` at
# the top (and bottom) of the body, with and without `jax.set_mesh`. Runs on any
# Equinox; the `in_shardings` rows only where `filter_jit` takes the keyword.
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
        print(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:100]}")


def body(x):
    return x * 2, "label"  # a non-array output too


try:
    eqx.filter_jit(body, in_shardings=None)
    has_keyword = True
except ValueError:
    has_keyword = False

for kind in (AxisType.Auto, AxisType.Explicit):
    mesh = jax.make_mesh((2,), ("x",), axis_types=(kind,))
    s, rep = NamedSharding(mesh, P("x")), NamedSharding(mesh, P())

    def top(x):
        return eqx.filter_shard(body(eqx.filter_shard(x, s)), rep)

    def top_in(x):
        return body(eqx.filter_shard(x, s))

    def ways(**jit):
        # Donation: no output sharding, so that an output can reuse the input's buffer.
        out_kw = {} if jit else {"out_shardings": rep}
        out = {}
        if has_keyword:
            f = eqx.filter_jit(body, in_shardings=s, **out_kw, **jit)
            out["in_shardings"] = (f, False)
        g = eqx.filter_jit(top_in if jit else top, **jit)
        out["filter_shard"] = (g, False)
        out["filter_shard + set_mesh"] = (g, True)
        return out

    def call(f, in_mesh, x):
        if not in_mesh:
            return f(x)
        with jax.set_mesh(mesh):
            return f(x)

    def lower(f, in_mesh, x):
        if not in_mesh:
            return f.lower(x).compile()
        with jax.set_mesh(mesh):
            return f.lower(x).compile()

    print(f"-- {kind}")
    for name, (f, in_mesh) in ways().items():
        x = jnp.arange(4.0)  # uncommitted
        placed = jax.device_put(x, s)
        run(
            f"{name}, uncommitted input: out",
            lambda: [
                o.sharding.spec if eqx.is_array(o) else o for o in call(f, in_mesh, x)
            ],
        )
        run(
            f"{name}, AOT lower(uncommitted), call on P('x')",
            lambda: lower(f, in_mesh, x)(placed)[0].sharding.spec,
        )
        run(
            f"{name}, input committed to P()",
            lambda: call(f, in_mesh, jax.device_put(x, rep))[0].sharding.spec,
        )
    for name, (f, in_mesh) in ways(donate="warn").items():
        for where, sharding in (("P('x')", s), ("P()", rep)):

            def donate():
                y = jax.device_put(jnp.arange(4.0), sharding)
                with warnings.catch_warnings(record=True) as w:
                    warnings.simplefilter("always")
                    call(f, in_mesh, y)
                msgs = [str(m.message)[:40] for m in w]
                return f"input deleted {y.is_deleted()}, warnings {msgs}"

            run(f"{name}, donated input committed to {where}", donate)
