"""0001 v22 (issue 65): what `_shares_a_shard` (two `devices_indices_map` calls
per leaf, on every eager move) costs beside the eager `filter_shard` that calls it.
100 leaves of 1024 floats, replicated -> a mesh of the first device only (it keeps its
slice, so the pre-copy runs too) and split -> split on the devices reversed (no device
keeps its slice); best of 5 rounds of 20 calls, one process.

    PYTHONPATH=<Equinox tree with 0001> python upstream/shares_a_shard_cost.py
"""

import timeit

import jax


jax.config.update("jax_num_cpu_devices", 2)
import equinox as eqx  # noqa: E402
import equinox._sharding as sharding_module  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.sharding as jshard  # noqa: E402


P, NS = jshard.PartitionSpec, jshard.NamedSharding
mesh = jax.make_mesh((2,), ("x",), axis_types=(jshard.AxisType.Explicit,))
other = jshard.Mesh(mesh.devices[::-1], ("x",), axis_types=mesh.axis_types)
one = jshard.Mesh(mesh.devices[:1], ("x",), axis_types=mesh.axis_types)
print("jax", jax.__version__)
cases = (
    ("replicated -> one device", NS(mesh, P()), NS(one, P("x"))),
    ("reversed -> split", NS(other, P("x")), NS(mesh, P("x"))),
)
for name, have, split in cases:
    tree = [jax.device_put(jnp.arange(1024.0), have) for _ in range(100)]

    def check():
        return [sharding_module._shares_a_shard(x, split) for x in tree]

    def move():
        jax.block_until_ready(eqx.filter_shard(tree, split))

    move()
    t_check = min(timeit.repeat(check, number=20, repeat=5)) / 20
    t_move = min(timeit.repeat(move, number=20, repeat=5)) / 20
    print(
        f"{name}: shares_a_shard {check()[0]}; 100 checks {t_check * 1e3:.2f} ms, "
        f"filter_shard {t_move * 1e3:.2f} ms, ratio {t_check / t_move:.3f}"
    )
