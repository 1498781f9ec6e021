# The statements in patch 0001 v12, PR.md and 1077.md that the fourth maintainer-style
# read questioned, each as printed rows. Runs against any Equinox tree on PYTHONPATH
# (v0.13.8 with and without 0001), on 2 simulated CPU devices.
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from rows import run


def spec(out):
    return [o.sharding.spec for o in jax.tree.leaves(out)]


auto = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Auto,))
mesh = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Explicit,))
split, rep = NamedSharding(mesh, P("x")), NamedSharding(mesh, P())
auto_split = NamedSharding(auto, P("x"))
x = jnp.arange(4.0)
jit_shard = eqx.filter_jit(eqx.filter_shard)

print("-- item 1: a sharding tree that is not a prefix of `x`")
for m in (auto, mesh):
    s = NamedSharding(m, P("x"))
    for how, f in (("eager", eqx.filter_shard), ("jit", jit_shard)):
        run(
            f"{m.axis_types[0]} {how} (x, x) to (s, s, s)", lambda: f((x, x), (s, s, s))
        )
        run(
            f"{m.axis_types[0]} {how} (x, x) to (s, None)", lambda: f((x, x), (s, None))
        )

print("-- item 3: `Explicit` and `Auto` shardings in one tree")
for how, f in (("eager", eqx.filter_shard), ("jit", jit_shard)):
    run(
        f"{how} (x, x) to (split, auto_split)",
        lambda: spec(f((x, x), (split, auto_split))),
    )

print("-- item 4: a constant closed over inside JIT (not traced: `device_put`)")
for c in (jnp.arange(4.0), np.arange(4.0)):
    for s in (split, rep):
        run(
            f"{type(c).__name__} to {s.spec}",
            lambda: spec(eqx.filter_jit(lambda: eqx.filter_shard(c, s) + 0)()),
        )

print("-- item 6: plain `jax.device_put` inside a trace")
run(
    "vmap of device_put to P('x') over (3, 4)",
    lambda: spec(jax.vmap(lambda r: jax.device_put(r, split))(jnp.zeros((3, 4)))),
)
run(
    "jit(grad) of device_put to P()",
    lambda: spec(jax.jit(jax.grad(lambda a: jax.device_put(a, rep).sum()))(x)),
)
run(
    "grad(jnp.sum) of an array split on the mesh",
    lambda: spec(jax.grad(jnp.sum)(jax.device_put(x, split))),
)

print("-- item 7: AOT, the input made outside or under `jax.set_mesh`")
for m in (auto, mesh):
    s, r = NamedSharding(m, P("x")), NamedSharding(m, P())
    top = eqx.filter_jit(lambda a: eqx.filter_shard(eqx.filter_shard(a, s) * 2, r))
    by_jit = jax.jit(lambda a: a * 2, in_shardings=s)
    for name, f in (("filter_shard", top), ("jax.jit(in_shardings=P('x'))", by_jit)):

        def outside(f=f, s=s, m=m):
            a = jnp.arange(4.0)
            with jax.set_mesh(m):
                return spec(f.lower(a).compile()(jax.device_put(a, s)))

        def inside(f=f, s=s, m=m):
            with jax.set_mesh(m):
                a = jnp.arange(4.0)
                return spec(f.lower(a).compile()(jax.device_put(a, s)))

        run(f"{m.axis_types[0]} {name}, made outside set_mesh", outside)
        run(f"{m.axis_types[0]} {name}, made under set_mesh", inside)

print("-- item 8: donating an input committed to P() that filter_shard moves to P('x')")
for m in (auto, mesh):
    s, r = NamedSharding(m, P("x")), NamedSharding(m, P())
    for out_rep in (False, True):

        def g(a, s=s, r=r, out_rep=out_rep):
            b = eqx.filter_shard(a, s) * 2
            return eqx.filter_shard(b, r) if out_rep else b

        def donate(g=g, r=r):
            a = jax.device_put(jnp.arange(4.0), r)
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                out = eqx.filter_jit(g, donate="warn")(a)
            return (
                f"out {out.sharding.spec}, deleted {a.is_deleted()}, {len(w)} warnings"
            )

        run(f"{m.axis_types[0]} output {'P()' if out_rep else 'P(x)'}", donate)
