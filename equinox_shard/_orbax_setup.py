"""How `save`, `restore` and `CheckpointManager` call orbax-checkpoint: its import, the
two items of a checkpoint (`leaves`, `arrays`), and the handler that writes `arrays`."""

import jax
import numpy as np


def orbax():
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:
        raise ImportError(
            "`equinox_shard.save` and `equinox_shard.restore` need orbax-checkpoint. "
            'Install it with `pip install "equinox_shard[checkpoint]"` (or '
            "`pip install orbax-checkpoint`)."
        ) from e
    return ocp


def composite(ocp, record: dict, arrays: dict):
    """orbax's arguments for a checkpoint of two items, `leaves` and `arrays`."""
    return ocp.args.Composite(
        leaves=ocp.args.JsonSave(record),  # pyright: ignore[reportCallIssue]
        # orbax refuses an empty item: a tree of Python scalars has none.
        **({"arrays": ocp.args.PyTreeSave(arrays)} if arrays else {}),  # pyright: ignore[reportCallIssue]
    )


def arrays_handler(ocp):
    """orbax's PyTree handler for the `arrays` item. In one process, without
    "replica-parallel" writing: that splits each replicated array into one slice per
    replica (eager slicing on the caller's thread, before `save` returns) so that
    several hosts share its writing; one process writes every slice anyway."""
    if jax.process_count() > 1:
        return ocp.PyTreeCheckpointHandler()
    handlers = ocp.type_handlers
    registry = handlers.create_type_handler_registry(
        (jax.Array, handlers.ArrayHandler(use_replica_parallel=False)),
        (np.ndarray, handlers.NumpyHandler()),
    )
    return ocp.PyTreeCheckpointHandler(type_handler_registry=registry)
