"""The lock under which the package hands JAX a buffer that another thread may donate
(RFC §6): `filter_jit`'s donating and multi-device CPU launches, and placement's
`jax.device_put`, each after looking again for inputs deleted meanwhile."""

import threading


# Serialises launches of multi-device CPU executables, donating calls and placements
# (upstream/jax-reports/cpu-multidevice-dispatch-threads, donate-from-threads).
dispatch_lock = threading.RLock()
