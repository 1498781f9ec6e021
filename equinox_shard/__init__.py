"""Filtered sharding for Equinox: PyTrees of arrays and non-arrays placed, constrained,
JIT-compiled, shard-mapped, pipelined and checkpointed across devices.

The source reads in this order: the root's `_arrays` (what an array or a sharding is),
`_buffers` (which buffers JAX shares), `_dispatch` (the lock of donating launches),
`_named` (leaves named by key path) and `_multihost` (several processes); the wing
`_spec` (the specification language); the root's `_placement` (the one placement),
`_sharding` (`filter_device_put`, `filter_shard`), `_state`, `_sharding_table` and
`_process_local_data`; then the wings `_jit` (`filter_jit`), `_manual`
(`filter_shard_map`, `filter_pipeline`) and `_checkpoint`. Each wing's `__init__.py`
gives its own reading order, what it exports and what it imports.
"""

import importlib.metadata as _metadata

from ._checkpoint.manager import CheckpointManager as CheckpointManager
from ._checkpoint.save_restore import restore as restore, save as save
from ._jit.filter_jit import (
    Compiled as Compiled,
    filter_jit as filter_jit,
    Lowered as Lowered,
)
from ._manual.pipeline import filter_pipeline as filter_pipeline
from ._manual.shard_map import filter_shard_map as filter_shard_map
from ._process_local_data import (
    filter_make_array_from_process_local_data as filter_make_array_from_process_local_data,  # noqa: E501
)
from ._sharding import (
    filter_device_put as filter_device_put,
    filter_shard as filter_shard,
)
from ._sharding_table import sharding_table as sharding_table
from ._spec.explain_rules import (
    explain_rules as explain_rules,
    RuleMatch as RuleMatch,
    RuleOverlap as RuleOverlap,
    RulesReport as RulesReport,
)
from ._spec.leaves import PathRules as PathRules
from ._state import state_specs as state_specs


__version__ = _metadata.version("equinox_shard")

# `Compiled` and `Lowered` are what `filter_jit(f).lower(...)` returns, never built by a
# user: importable as before, but not public, as Equinox keeps its own.
__all__ = [
    "CheckpointManager",
    "explain_rules",
    "filter_device_put",
    "filter_jit",
    "filter_make_array_from_process_local_data",
    "filter_pipeline",
    "filter_shard",
    "filter_shard_map",
    "PathRules",
    "restore",
    "RuleMatch",
    "RuleOverlap",
    "RulesReport",
    "save",
    "sharding_table",
    "state_specs",
]
