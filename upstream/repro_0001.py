"""What `eqx.filter_shard` does on meshes with `Explicit` axes, with no `jax.set_mesh`,
against the Equinox found on `PYTHONPATH` (8 CPU devices): each case's result, eager
and inside `eqx.filter_jit`, and eagerly how many bytes the largest intermediate
result held against the final one ("peak/final" > 1: the array was copied onto more
devices on the way, e.g. gathered before being split again); then under `jax.vmap`
(the spec applies to each example on `Auto` axes) and under `eqx.filter_grad`.

    PYTHONPATH=/path/to/equinox/tree python upstream/repro_0001.py
"""

import jax


jax.config.update("jax_num_cpu_devices", 8)
import jax.core  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402
import jax.sharding as jshard  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402


held = []


def _record(f):
    def wrapped(*args, **kwargs):
        out = f(*args, **kwargs)
        for leaf in jax.tree.leaves(out):
            if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
                held.append(sum(s.data.nbytes for s in leaf.addressable_shards))
        return out

    return wrapped


# Every operation a `filter_shard` may call.
jax.lax.with_sharding_constraint = _record(jax.lax.with_sharding_constraint)
jax.device_put = _record(jax.device_put)
jshard.reshard = _record(jshard.reshard)
import equinox as eqx  # noqa: E402  (after: it may keep a reference to `reshard`)


E, A, U = AxisType.Explicit, AxisType.Auto, P.UNCONSTRAINED
print("jax", jax.__version__, "equinox from", eqx.__file__)
x = jnp.arange(32.0).reshape(8, 4)
explicit = jax.make_mesh((2, 4), ("x", "y"))  # the default: both `Explicit`
ea = jax.make_mesh((2, 4), ("x", "y"), axis_types=(E, A))
ae = jax.make_mesh((2, 4), ("x", "y"), axis_types=(A, E))
mlp = eqx.nn.MLP(4, 4, 8, 2, key=jr.PRNGKey(0))
cases = [
    # (mesh, input spec or None for uncommitted, target spec, input)
    (explicit, None, P(), x),
    (explicit, None, P("x"), x),
    (explicit, P("x"), P(), x),
    (explicit, P("x"), P(None, "y"), x),
    (explicit, None, P(), mlp),
    (explicit, None, P("x"), mlp),
    (ea, P(None, "y"), P(), x),
    (ea, P(None, "y"), P(None, U), x),
    (ea, P("x"), P(None, "y"), x),
    (ea, P("x"), P("x", "y"), x),
    (ea, None, P("x", "y"), x),
    (ae, P(None, "y"), P("x"), x),
    (ae, P("x"), P(None, "y"), x),
]
shard_jit = eqx.filter_jit(eqx.filter_shard)
for mesh, source, spec, value in cases:
    target = NamedSharding(mesh, spec)
    if source is not None:
        value = jax.device_put(value, NamedSharding(mesh, source))
    kinds = "".join(t.name[0] for t in mesh.axis_types)
    what = "MLP" if value is mlp else "x"
    row = f"{kinds} {what} from {source or 'uncommitted'} to {spec}:"
    for name, shard in (("eager", eqx.filter_shard), ("jit", shard_jit)):
        held.clear()
        try:
            out = shard(value, target)
        except Exception as e:
            row += f" {name} {type(e).__name__}: {str(e).splitlines()[0][:60]};"
            continue
        arrays = jax.tree.leaves(eqx.filter(out, eqx.is_array))
        a = arrays[0]
        placed = all(
            b.addressable_shards[0].data.shape == target.shard_shape(b.shape)
            for b in arrays
        ) or (U in spec and a.sharding.is_equivalent_to(value.sharding, a.ndim))
        same = bool(eqx.tree_equal(out, value))
        row += f" {name} {a.sharding.spec}{'' if placed and same else ' WRONG'}"
        if a.sharding == target:
            row += " (== target)"
        if name == "eager" and held:
            final = max(
                sum(s.data.nbytes for s in b.addressable_shards) for b in arrays
            )
            row += f" peak/final {max(held) / final:.0f}"
        row += ";"
    print(row)


# Under `vmap`, eagerly and inside JIT: on `Auto` axes the spec applies to each example.
auto = jax.make_mesh((2, 4), ("x", "y"), axis_types=(A, A))
for mesh in (auto, explicit):
    kinds = "".join(t.name[0] for t in mesh.axis_types)
    f = jax.vmap(lambda r, m=mesh: eqx.filter_shard(r, NamedSharding(m, P("y"))))
    row = f"{kinds} vmap over (3, 8) to P('y',):"
    for name, g in (("eager", f), ("jit", eqx.filter_jit(f))):
        try:
            row += f" {name} {g(jnp.zeros((3, 8))).sharding.spec};"
        except Exception as e:
            row += f" {name} {type(e).__name__}: {str(e).splitlines()[0][:60]};"
    print(row)
# Differentiated inside JIT (JAX asks for `jax.set_mesh` where `reshard` moves an array;
# `P()` from no mesh worked at v0.13.8, and from `P('x')` ran but left it split).
for source, spec in ((None, P()), (None, P("x")), (P("x"), P())):
    loss = lambda a, s=spec: eqx.filter_shard(a, NamedSharding(explicit, s)).sum()
    value = x if source is None else jax.device_put(x, NamedSharding(explicit, source))
    try:
        out = eqx.filter_jit(eqx.filter_grad(loss))(value).sharding.spec
    except Exception as e:
        out = f"{type(e).__name__}: {str(e).splitlines()[0][:60]}"
    print(f"EE grad of x from {source or 'uncommitted'} to {spec} inside jit: {out}")
