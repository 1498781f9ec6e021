# The statements of patch 0001 v17, PR.md and 1077.md that issue 65 (the eleventh
# maintainer-style read) asked about, each as printed rows. Runs against any Equinox
# tree on PYTHONPATH (v0.13.8 with and without 0001), on 2 simulated CPU devices.
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import rows
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P


run = rows.run
auto = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Auto,))
mesh = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Explicit,))
split, rep = NamedSharding(mesh, P("x")), NamedSharding(mesh, P())
auto_split = NamedSharding(auto, P("x"))
x = jnp.arange(4.0)
jit_shard = eqx.filter_jit(eqx.filter_shard)

print("-- 1: a constant closed over inside filter_jit")
for have, want in (("P()", "P('x')"), ("P('x')", "P()")):
    c = jax.device_put(x, rep if have == "P()" else split)
    s = split if want == "P('x')" else rep
    run(
        f"{have} -> {want}",
        lambda: eqx.filter_jit(lambda: eqx.filter_shard(c, s))().sharding.spec,
    )
    run(
        f"{have} -> {want}, plain jax.jit(device_put)",
        lambda: jax.jit(lambda: jax.device_put(c, s))().sharding.spec,
    )

print("-- 2: jit(grad) of a * filter_shard(a, P('x')), no jax.set_mesh")
f = jax.jit(jax.grad(lambda a: (a * eqx.filter_shard(a, split)).sum()))
run("a on no mesh", lambda: f(jnp.arange(16.0)).sharding.spec)
run(
    "a put on the mesh first",
    lambda: f(jax.device_put(jnp.arange(16.0), rep)).sharding.spec,
)
run(
    "plain JAX device_put(a, P('x')), a on no mesh",
    lambda: (
        jax.jit(jax.grad(lambda a: (a * jax.device_put(a, split)).sum()))(
            jnp.arange(16.0)
        ).sharding.spec
    ),
)

print("-- 3: eager, an array on other devices")
for name, m in (("Explicit", mesh), ("Auto", auto)):
    other = Mesh(m.devices[::-1], ("x",), axis_types=m.axis_types)
    y = jax.device_put(x, NamedSharding(other, P("x")))
    target = NamedSharding(m, P("x"))
    run(f"{name}", lambda: eqx.filter_shard(y, target).sharding.mesh.devices.tolist())
    run(
        f"{name}, beside an Explicit leaf",
        lambda: [o.sharding.spec for o in eqx.filter_shard((x, y), (split, target))],
    )

print("-- 4: errors, eager and inside filter_jit, each mesh")
for name, s in (("Explicit", split), ("Auto", auto_split)):
    for where, shard in (("eager", eqx.filter_shard), ("jit", jit_shard)):
        run(f"{name} {where}, not a tree prefix", lambda: shard((x, x), (s, s, s)))
        run(
            f"{name} {where}, None among the shardings",
            lambda: shard((x, x), (s, None)),
        )
        run(f"{name} {where}, 0-d array to P('x')", lambda: shard(jnp.array(1.0), s))

print("-- 5: a mesh of Explicit and Auto axes")
mixed = jax.make_mesh((2, 1), ("x", "y"), axis_types=(AxisType.Explicit, AxisType.Auto))
for where, shard in (("eager", eqx.filter_shard), ("jit", jit_shard)):
    run(
        f"{where}, P('x') (Explicit axis)",
        lambda: shard(x, NamedSharding(mixed, P("x"))).sharding.spec,
    )
    run(
        f"{where}, P('y') (Auto axis)",
        lambda: shard(x, NamedSharding(mixed, P("y"))).sharding.spec,
    )

print("-- 6: PR.md's list, JAX 0.10 and later")
run("eager P('x')", lambda: eqx.filter_shard(x, split).sharding.spec)
run(
    "jit P('x'), input on no mesh, no set_mesh",
    lambda: jit_shard(x, split).sharding.spec,
)
run(
    "jit replicated of a split array",
    lambda: jit_shard(jax.device_put(x, split), rep).sharding.spec,
)
with jax.set_mesh(mesh):
    run(
        "jit replicated of a split array, set_mesh",
        lambda: jit_shard(jax.device_put(x, split), rep).sharding.spec,
    )
run(
    "vmap P('x') per example (3, 4)",
    lambda: (
        jax.vmap(lambda r: eqx.filter_shard(r, split))(jnp.zeros((3, 4))).sharding.spec
    ),
)
run(
    "vmap replicated",
    lambda: (
        jax.vmap(lambda r: eqx.filter_shard(r, rep))(jnp.zeros((3, 4))).sharding.spec
    ),
)
run(
    "vmap P('x'), batch split over 'x'",
    lambda: (
        jax.vmap(lambda r: eqx.filter_shard(r, split))(
            jax.device_put(jnp.zeros((2, 4)), split)
        ).sharding.spec
    ),
)
with jax.set_mesh(mesh):
    run("bare P('x') under set_mesh, jit", lambda: jit_shard(x, P("x")).sharding.spec)
xs = jax.device_put(x, split)
run(
    "release note: jit(grad(sum(filter_shard(split, replicated)))), no set_mesh",
    lambda: (
        jax.jit(jax.grad(lambda a: jnp.sum(eqx.filter_shard(a, rep))))(xs).sharding.spec
    ),
)
with jax.set_mesh(mesh):
    run(
        "the same under set_mesh",
        lambda: (
            jax.jit(jax.grad(lambda a: jnp.sum(eqx.filter_shard(a, rep))))(
                xs
            ).sharding.spec
        ),
    )

print("-- 7: 1077.md point 1, a donated input already in the target layout")
for kind in (AxisType.Auto, AxisType.Explicit):
    m = jax.make_mesh((2,), ("x",), axis_types=(kind,))
    s = NamedSharding(m, P("x"))
    bodies = {
        "output reuses it (x * 2)": lambda a: a * 2,
        "no output can (x[:2])": lambda a: a[:2],
    }
    for bname, body in bodies.items():
        ways = {
            "filter_shard": eqx.filter_jit(
                lambda a, body=body: body(eqx.filter_shard(a, s)), donate="all"
            ),
            "jax.jit": jax.jit(body, donate_argnums=0),
        }
        for wname, g in ways.items():

            def donate():
                y = jax.device_put(jnp.arange(4.0), s)
                with warnings.catch_warnings(record=True):
                    warnings.simplefilter("always")
                    g(y)
                return f"deleted {y.is_deleted()}"

            run(f"{kind.name}, {bname}, {wname}", donate)

print(
    "-- 8: 1077.md, point 1's exception and point 3, plain jax.jit given in_shardings"
)
for kind in (AxisType.Auto, AxisType.Explicit):
    m = jax.make_mesh((2,), ("x",), axis_types=(kind,))
    s, r = NamedSharding(m, P("x")), NamedSharding(m, P())
    with jax.set_mesh(m):
        made = jnp.arange(4.0)
    run(
        f"{kind.name}, made under set_mesh: committed, spec",
        lambda: (made.committed, made.sharding.spec),
    )
    top = eqx.filter_jit(lambda a: eqx.filter_shard(eqx.filter_shard(a, s) * 2, r))
    run(
        f"{kind.name}, filter_shard program lowered on uncommitted, called on it",
        lambda: top.lower(jnp.arange(4.0)).compile()(made).sharding.spec,
    )
    run(
        f"{kind.name}, jax.jit(in_shardings=P('x')) on it",
        lambda: jax.jit(lambda a: a * 2, in_shardings=s)(made).sharding.spec,
    )
    on_r = jax.device_put(jnp.arange(4.0), r)
    run(
        f"{kind.name}, jax.jit(in_shardings=P('x')) on an input committed to P()",
        lambda: jax.jit(lambda a: a * 2, in_shardings=s)(on_r).sharding.spec,
    )
    run(
        f"{kind.name}, the same, donated",
        lambda: (
            jax.jit(lambda a: a * 2, in_shardings=s, donate_argnums=0)(
                jax.device_put(jnp.arange(4.0), r)
            ).sharding.spec
        ),
    )
    run(
        f"{kind.name}, filter_shard on it inside filter_jit",
        lambda: (
            eqx.filter_jit(lambda a: eqx.filter_shard(a, s) * 2)(on_r).sharding.spec
        ),
    )
