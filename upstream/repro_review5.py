# The statements in patch 0001 v12, PR.md and 1077.md that the fifth maintainer-style
# read questioned, each as printed rows. Runs against any Equinox tree on PYTHONPATH
# (v0.13.8 with and without 0001), on 2 simulated CPU devices.
import functools as ft

import equinox as eqx
import jax
import jax.numpy as jnp
import rows
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P


# As this script first printed them (upstream/outputs/repro_review5.txt).
run = ft.partial(rows.run, width=100, cause=False)
auto = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Auto,))
mesh = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Explicit,))
split, rep = NamedSharding(mesh, P("x")), NamedSharding(mesh, P())
auto_split = NamedSharding(auto, P("x"))
x = jnp.arange(4.0)
xs = jax.device_put(x, split)

print("-- item 1/2: jit(grad) through filter_shard, no jax.set_mesh")
for name, target, a in (("x to P('x')", split, x), ("split to P()", rep, xs)):
    sin = lambda a: jnp.sum(jnp.sin(eqx.filter_shard(a, target)))
    bare = lambda a: jnp.sum(eqx.filter_shard(a, target))
    run(f"{name}, jnp.sum(jnp.sin(.))", lambda: jax.jit(jax.grad(sin))(a).sharding.spec)
    run(f"{name}, jnp.sum(.)", lambda: jax.jit(jax.grad(bare))(a).sharding.spec)
run("plain JAX: jax.grad(jnp.sum)(split)", lambda: jax.grad(jnp.sum)(xs).sharding.spec)

print("-- item 3: moving a traced array from no mesh, plain JAX")
put = lambda a: jax.device_put(a, split)
via = lambda a: jax.sharding.reshard(jax.device_put(a, rep), split)
for name, f in (("device_put", put), ("device_put P() then reshard", via)):
    run(
        f"jit(grad) jnp.sum(jnp.sin(.)), {name}",
        lambda: jax.jit(jax.grad(lambda a: jnp.sum(jnp.sin(f(a)))))(x).sharding.spec,
    )
    run(
        f"jit(grad) jnp.sum(.), {name}",
        lambda: jax.jit(jax.grad(lambda a: jnp.sum(f(a))))(x).sharding.spec,
    )
    # P('x',) on a 2-D result is P('x', None): the batch axis split.
    run(f"vmap, {name}", lambda: jax.vmap(f)(jnp.zeros((2, 4))).sharding.spec)

print("-- item 4: `Explicit` and `Auto` shardings in one tree")
both = lambda a, b: (
    jax.sharding.reshard(jax.device_put(a, rep), split),
    jax.lax.with_sharding_constraint(b, auto_split),
)
run(
    "plain jax.jit, reshard + with_sharding_constraint: mesh axis types",
    lambda: [o.sharding.mesh.axis_types for o in jax.jit(both)(x, x)],
)
for how, g in (("eager", eqx.filter_shard), ("jit", eqx.filter_jit(eqx.filter_shard))):
    run(
        f"{how}: sharding == target",
        lambda: [
            o.sharding == s
            for o, s in zip(g((x, x), (split, auto_split)), (split, auto_split))
        ],
    )
    run(
        f"{how}: mesh axis types",
        lambda: [o.sharding.mesh.axis_types for o in g((x, x), (split, auto_split))],
    )

print(
    "-- item 7: `.lower(...).compile()` on inputs off the mesh, called on placed ones"
)
step = eqx.filter_jit(lambda a: eqx.filter_shard(eqx.filter_shard(a, split) * 2, rep))
run(
    "step.lower(x).compile()(filter_shard(x, split)): value, spec",
    lambda: (lambda o: (o.tolist(), o.sharding.spec))(
        step.lower(x).compile()(eqx.filter_shard(x, split))
    ),
)
