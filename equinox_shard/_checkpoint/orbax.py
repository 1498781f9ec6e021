"""How the checkpoints call orbax-checkpoint (its failed saves: `failures`)."""

import functools as ft
import threading

import jax
import numpy as np


# orbax's "directories created" signals are per process: two saves at once mixed them.
LOCK = threading.RLock()


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


@ft.cache
def writes(dtype: np.dtype) -> bool:
    """Whether orbax can write an array of `dtype`: one TensorStore names (orbax
    fails on the others partway through its write, on its own threads)."""
    import tensorstore as ts

    try:
        ts.dtype(dtype.name)
    except ValueError:
        return False
    return True


def composite(ocp, record: dict, arrays: dict):
    """orbax's arguments for a checkpoint of two items, `leaves` and `arrays`."""
    return ocp.args.Composite(
        leaves=ocp.args.JsonSave(record),  # pyright: ignore[reportCallIssue]
        # orbax refuses an empty item: a tree of Python scalars has none.
        **({"arrays": ocp.args.PyTreeSave(arrays)} if arrays else {}),  # pyright: ignore[reportCallIssue]
    )


def handlers(ocp) -> dict:
    """orbax's handlers of the two items; in one process without "replica-parallel"
    writing, there only eager slicing on the caller's thread (docs/checkpoints.md)."""
    if jax.process_count() > 1:
        arrays = ocp.PyTreeCheckpointHandler()
    else:
        types = ocp.type_handlers
        registry = types.create_type_handler_registry(
            (jax.Array, types.ArrayHandler(use_replica_parallel=False)),
            (np.ndarray, types.NumpyHandler()),
        )
        arrays = ocp.PyTreeCheckpointHandler(type_handler_registry=registry)
    return {"leaves": ocp.JsonCheckpointHandler(), "arrays": arrays}
