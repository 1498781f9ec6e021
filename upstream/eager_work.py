# Python calls and bytecodes of one eager `filter_shard` of a small MLP (Auto mesh):
# PYTHONPATH=/path/to/equinox/tree python upstream/eager_work.py NAME
import pathlib
import sys

import equinox as eqx
import jax
import jax.random as jr
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P


sys.path.insert(0, str(pathlib.Path(__file__).parent))
from dispatch import python_work  # noqa: E402


jax.config.update("jax_num_cpu_devices", 2)
mesh = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Auto,))
rep = NamedSharding(mesh, P())
mlp = eqx.nn.MLP(4, 4, 8, 2, key=jr.PRNGKey(0))
for _ in range(5):
    eqx.filter_shard(mlp, rep)
work = python_work(lambda: eqx.filter_shard(mlp, rep))
print(sys.argv[1], "eager filter_shard of an MLP: Python calls / bytecodes", work)
