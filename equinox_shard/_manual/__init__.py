"""Manual parallelism on `jax.shard_map`: `filter_shard_map`, and `filter_pipeline`
built on it.

Read `shard_map` first, then `pipeline`.

Exports `shard_map` and `pipeline` to the package.

Imports `_arrays`, `_named` and the wing `_spec`.
"""
