"""Benchmarks of `equinox_shard` against what a user would otherwise call: `jax.jit`,
`jax.device_put`, `equinox.filter_jit` and `equinox.filter_shard`. Run them all with
`python -m benchmarks` (see `benchmarks/run.py`)."""
