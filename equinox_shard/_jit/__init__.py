"""`filter_jit`: the wrapper, its cache and the call path to `jax.jit`.

Read `filter_jit` first (the public wrapper, its ahead-of-time objects and the one call
path), then `cache` (the cache and its keys), `entry` (an entry built, traced and
frozen), `traced_body` (the function `jax.jit` traces), `packing` (the forms in which
PyTrees cross `jax.jit`), `donation`, `launch` (an entry's dispatch and its lock),
`callbacks` (host callbacks and Equinox's runtime errors) and `explain_misses` (JAX's
`jax_explain_cache_misses` for our cache).
"""
