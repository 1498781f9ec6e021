"""Shared by the `repro_review*.py` scripts: 2 simulated CPU devices, and `run`, which
prints one row: what `f()` returns, or the first line of what it raises."""

import equinox as eqx
import jax


jax.config.update("jax_num_cpu_devices", 2)
print("jax", jax.__version__, "equinox from", eqx.__file__)


def run(name, f, width=110, cause=True):
    try:
        print(f"{name}: {f()}")
    except Exception as e:
        why = f" (from {type(e.__cause__).__name__})" if cause and e.__cause__ else ""
        print(f"{name}: {type(e).__name__}{why}: {str(e).splitlines()[0][:width]}")
