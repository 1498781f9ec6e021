"""Filtered sharding for Equinox.

`filter_device_put` transfers, `filter_shard` places or constrains (eagerly and inside a
trace), and `filter_jit` is `equinox.filter_jit` with `in_shardings`/`out_shardings`.
"""

import importlib.metadata

from ._inspect import sharding_table as sharding_table
from ._jit import Compiled as Compiled, filter_jit as filter_jit, Lowered as Lowered
from ._process_local import (
    filter_make_array_from_process_local_data as filter_make_array_from_process_local_data,  # noqa: E501
)
from ._sharding import (
    filter_device_put as filter_device_put,
    filter_shard as filter_shard,
)


__version__ = importlib.metadata.version("equinox_shard")
