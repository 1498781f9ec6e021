"""0001 v23 (issue 65, B1 of the read of v22): a `device_or_shardings` that is not a
tree prefix of `x`, on an `Auto` and on an `Explicit` mesh, eagerly: `filter_shard`'s
error beside `with_sharding_constraint`'s own. Run outside pytest, so without Equinox's
test-time type checking (which rejects a dict of shardings at v0.13.8).

    PYTHONPATH=<Equinox tree> python upstream/repro_prefix_error.py
"""

import jax


jax.config.update("jax_num_cpu_devices", 2)
import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.sharding as jshard  # noqa: E402


print("jax", jax.__version__, "equinox", eqx.__file__)
x = {"a": jnp.arange(4.0), "b": (jnp.arange(4.0), jnp.arange(4.0))}
for axis_type in (jshard.AxisType.Auto, jshard.AxisType.Explicit):
    mesh = jax.make_mesh((2,), ("x",), axis_types=(axis_type,))
    s = jshard.NamedSharding(mesh, jshard.PartitionSpec("x"))
    shardings = {"a": s, "b": (s,)}
    print(f"{axis_type.name} mesh")
    for name, f in (
        ("with_sharding_constraint", jax.lax.with_sharding_constraint),
        ("filter_shard", eqx.filter_shard),
    ):
        try:
            f(x, shardings)
            print(f"  {name}: no error")
        except Exception as e:
            msg = " | ".join(str(e).splitlines())
            cause = type(e.__cause__).__name__ if e.__cause__ else None
            print(f"  {name}: {type(e).__name__}: {msg} (__cause__: {cause})")
