"""How many copies an eager `eqx.filter_shard` makes on `Explicit` axes (4 CPU devices).

    PYTHONPATH=<patched Equinox> python upstream/repro_copies.py

`jax.device_put`, the only function that the eager path copies with, is wrapped to
compare each result's per-device buffers (`unsafe_buffer_pointer`) with its input's: a
"full copy" has no buffer in common with its input, a "partial" one keeps some. Then,
for each case, the input is deleted and the result read, and the result donated and the
input read, to check that the result is independent."""

import sys

import jax


jax.config.update("jax_num_cpu_devices", 4)
import equinox as eqx
import jax.numpy as jnp
import jax.sharding as jshard
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P


_put = jax.device_put
log = []


def pointers(a):
    return {s.device.id: s.data.unsafe_buffer_pointer() for s in a.addressable_shards}


def counting_put(x, device=None, *args, **kwargs):
    out = _put(x, device, *args, **kwargs)
    for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(out)):
        old, new = pointers(a), pointers(b)
        log.append((len(new), sum(p not in old.values() for p in new.values())))
    return out


jax.device_put = counting_put
print("python", sys.version.split()[0], "jax", jax.__version__, "equinox", eqx.__file__)
devices = jax.devices()
explicit = (AxisType.Explicit,)
line = jax.make_mesh((4,), ("x",), axis_types=explicit)
line2 = jax.make_mesh((4,), ("x",), axis_types=explicit)  # another object, same devices
backwards = jshard.Mesh(devices[::-1], ("x",), axis_types=explicit)
square = jax.make_mesh((2, 2), ("x", "y"), axis_types=explicit * 2)
small = jshard.Mesh(devices[:2], ("x",), axis_types=explicit)
auto = jax.make_mesh((4,), ("x",), axis_types=(AxisType.Auto,))
cases = [
    ("P('x') -> the same sharding", (line, P("x")), (line, P("x"))),
    ("P('x') -> P('x') on another equal mesh", (line, P("x")), (line2, P("x"))),
    ("P() -> the same sharding", (line, P()), (line, P())),
    ("2x2 P('x', 'y') -> the same sharding", *[(square, P("x", "y"))] * 2),
    ("2x2 P('x') -> the same sharding", (square, P("x")), (square, P("x"))),
    ("P() -> P() on the devices in reverse", (line, P()), (backwards, P())),
    ("P('x') on devices 0,1 -> P('x') on 2x2", (small, P("x")), (square, P("x"))),
    ("P('x') -> P()", (line, P("x")), (line, P())),
    ("P() -> P('x')", (line, P()), (line, P("x"))),
    ("Auto P('x') -> the same sharding", (auto, P("x")), (auto, P("x"))),
]
donate = jax.jit(lambda a: a + 1, donate_argnums=0)
want = np.arange(16.0).reshape(4, 4)
for name, have, target in cases:
    have, target = NamedSharding(*have), NamedSharding(*target)
    x = _put(jnp.asarray(want), have)
    log.clear()
    y = eqx.filter_shard(x, target)
    calls, full = len(log), sum(new == n for n, new in log)
    partial = [f"{new} of {n} shards" for n, new in log if 0 < new < n]
    x.delete()
    independent = (np.asarray(y) == want).all()
    x = _put(jnp.asarray(want), have)
    donate(eqx.filter_shard(x, target))
    independent = independent and not x.is_deleted() and (np.asarray(x) == want).all()
    print(
        f"{name}: device_put calls {calls}, full copies {full}, partial"
        f" {partial or 'none'}; at its target {y.sharding.is_equivalent_to(target, 2)};"
        f" independent of the input {bool(independent)}"
    )
