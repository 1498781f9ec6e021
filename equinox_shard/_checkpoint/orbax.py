"""How the checkpoints call orbax-checkpoint."""

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


def operation_id() -> str:
    """orbax's id of the save it started last in this process (call under `LOCK`)."""
    from orbax.checkpoint._src.futures import synchronization

    return synchronization.OperationIdGenerator.get_current_operation_id()


def release(operation: str) -> None:
    """Sends the threads of orbax's failed save `operation` the signals they wait for
    (else Python waits for them at exit: RFC.md, 10.15); each then fails on its own."""
    if jax.process_count() > 1:
        return  # the signals are the job's: its other processes wait on them too
    try:
        from orbax.checkpoint._src.futures import future, signaling_client

        thread_type, contract = future._SignalingThread, future.AwaitableSignalsContract
    except (ImportError, AttributeError):
        return
    client = signaling_client.get_signaling_client()
    for thread in threading.enumerate():
        waiting = isinstance(thread, thread_type) and thread.is_alive()
        if not waiting or getattr(thread, "_operation_id", None) != operation:
            continue
        for signal in getattr(thread, "_receive_signals", ()):
            key = contract.get_unique_awaitable_singal_key(signal, operation)
            if client.key_value_try_get(key) is None:
                client.key_value_set(key, "released", allow_overwrite=True)
