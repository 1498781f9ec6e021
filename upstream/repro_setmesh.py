"""0001 v20's B1 (issue 65, third review): `filter_shard` under `jax.set_mesh` inside
`jax.jit(jax.grad(...))`, for an input on no mesh, with the context mesh the sharding's
own, its devices reversed, another axis name, or `Auto` axes.

    PYTHONPATH=<Equinox tree> python upstream/repro_setmesh.py
"""

import jax


jax.config.update("jax_num_cpu_devices", 2)
import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.sharding as jshard  # noqa: E402


P, NS, E = jshard.PartitionSpec, jshard.NamedSharding, jshard.AxisType.Explicit
mesh = jax.make_mesh((2,), ("x",), axis_types=(E,))
rev = jshard.Mesh(mesh.devices[::-1], ("x",), axis_types=(E,))
named_y = jax.make_mesh((2,), ("y",), axis_types=(E,))
auto = jax.make_mesh((2,), ("x",), axis_types=(jshard.AxisType.Auto,))
split = NS(mesh, P("x"))
x = jnp.arange(4.0)
cases = {
    "jit filter_shard": lambda: jax.jit(lambda a: eqx.filter_shard(a, split))(x),
    "jit grad a*fs": lambda: jax.jit(
        jax.grad(lambda a: (a * eqx.filter_shard(a, split)).sum())
    )(x),
    "jit grad a*reshard": lambda: jax.jit(
        jax.grad(lambda a: (a * jshard.reshard(a, split)).sum())
    )(x),
    "vmap jit": lambda: jax.jit(jax.vmap(lambda r: eqx.filter_shard(r, split)))(
        jnp.zeros((3, 4))
    ),
}
print("JAX", jax.__version__)
for ctxname, ctx in [
    ("same mesh", mesh),
    ("reversed devices", rev),
    ("axis y", named_y),
    ("auto mesh", auto),
]:
    for name, f in cases.items():
        try:
            with jax.set_mesh(ctx):
                out = f()
            values = out.tolist() if out.ndim == 1 else ""
            print(f"{ctxname:17s} {name:18s} OK {out.sharding.spec} {values}")
        except Exception as e:
            first = str(e).splitlines()[0][:110] if str(e) else ""
            print(f"{ctxname:17s} {name:18s} {type(e).__name__}: {first}")
