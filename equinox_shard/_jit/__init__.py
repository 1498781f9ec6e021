"""`filter_jit`: the wrapper, its cache and the call path to `jax.jit`.

Read `filter_jit` first (the call path, `_call`: look up, prepare, dispatch, combine;
the ahead-of-time objects; the public wrapper), then `cache` (the cache and its keys),
`entry` (an entry built in steps, and each call's `prepare`), `traced_body` (the
function `jax.jit` traces), `packing` (the forms in which PyTrees cross `jax.jit`),
`donation`, `launch` (the dispatch's launch, layers and lock), `callbacks` (host
callbacks and Equinox's runtime errors) and `explain_misses` (JAX's
`jax_explain_cache_misses` for our cache).

Exports `filter_jit` (with `Compiled` and `Lowered`) to the package.

Imports `_arrays`, `_buffers`, `_dispatch`, `_named`, `_placement` and the wing `_spec`.
"""
