"""What happens when a save fails or is interrupted (docs/checkpoints.md, "When a save
fails"): `tidy`, `writing` (`save`, and `overwrite=True`'s two renames), `Pending`."""

import contextlib
import errno
import logging
import os
import pathlib
import shutil
import threading
import time
from collections.abc import Callable, Iterator

import jax

from .orbax import LOCK


logger = logging.getLogger("equinox_shard")


# `overwrite=True` writes at `SWAP`, renames the old one to `OLD` and `SWAP` to `path`.
SWAP = ".eqxs-overwrite"
OLD = ".eqxs-old"


def _sibling(path: pathlib.Path, suffix: str) -> pathlib.Path:
    return path.with_name(path.name + suffix)


def found(path: pathlib.Path) -> pathlib.Path:
    """Where the checkpoint of `path` is: at `SWAP` if killed between the renames."""
    swap = _sibling(path, SWAP)
    if not path.is_dir() and swap.is_dir() and _sibling(path, OLD).is_dir():
        return swap
    return path


def unfinished(path: pathlib.Path, *suffixes: str) -> list[pathlib.Path]:
    """The temporary directories an interrupted save to `path` left beside it."""
    if not path.parent.is_dir():
        return []
    names = tuple(path.name + s for s in (".orbax-checkpoint-tmp", *suffixes))
    return sorted(p for p in path.parent.iterdir() if p.name.startswith(names))


def tidy(path: pathlib.Path) -> None:
    """Finishes or removes what an interrupted save to `path` left beside it."""
    if (swap := found(path)) != path:
        os.rename(swap, path)  # killed between the two renames: `swap` is complete
    for p in unfinished(path, SWAP, OLD):
        shutil.rmtree(p, ignore_errors=True)


def _error(e: BaseException, message: str) -> Exception:
    """An `OSError` with the `errno` of `e` (or of its message), else `RuntimeError`."""
    code = e.errno if isinstance(e, OSError) else None
    for known in (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EDQUOT):
        code = code or (known if os.strerror(known) in str(e) else None)
    return OSError(code, message) if code else RuntimeError(message)


@contextlib.contextmanager
def writing(
    path: pathlib.Path, sync: Callable[[str], object]
) -> Iterator[pathlib.Path]:
    """Where the save to `path` writes (beside an existing `path`, swapped in once
    written); a failure raises naming `path`, once what it wrote is removed."""
    first = jax.process_index() == 0
    if first:
        tidy(path)
    sync("equinox_shard.save.tidy")
    target = _sibling(path, SWAP) if path.exists() else path
    try:
        yield target
    except Exception as e:
        if first:
            tidy(path)
        raise _error(e, f"The save to {path} failed: {type(e).__name__}: {e}") from e
    if target != path:
        if first:
            os.rename(path, _sibling(path, OLD))
            os.rename(target, path)
            shutil.rmtree(_sibling(path, OLD))
        sync("equinox_shard.save.swap")


class Pending:
    """A `CheckpointManager`'s saves not yet logged: each is logged once final, or its
    failure raised once, naming its step."""

    def __init__(self, directory: pathlib.Path):
        self.directory = directory
        self.steps: dict[int, tuple[int, float, str]] = {}  # (bytes, start, operation)
        self.lock = threading.Lock()
        self.reported: set[str] = set()

    def finished(self) -> None:
        """Logs each step whose directory is final (orbax renames it when complete)."""
        with self.lock:
            done = [s for s in self.steps if (self.directory / str(s)).is_dir()]
            for step in sorted(done):
                size, start, _ = self.steps.pop(step)
                logger.info(
                    "saved step %d to %s: %d bytes in %.2f s",
                    step, self.directory / str(step), size,
                    time.perf_counter() - start,
                )  # fmt: skip

    def save(self, save: Callable[..., bool], step: int, size: int, **kwargs) -> bool:
        """orbax's `save(step, **kwargs)`; raises an earlier save's failure, named."""
        start = time.perf_counter()
        with LOCK:
            saved = False
            for again in (False, True):
                try:
                    saved = save(step, **kwargs)
                    break
                except Exception as e:
                    # orbax raised again (once per thread) a failure named already.
                    if (error := self._named(e, step)) is not None or again:
                        raise (error or e) from e
            with self.lock:
                self.steps[step] = (size, start, operation_id())
        return saved

    def wait(self, *calls: Callable[[], object]) -> None:
        """Calls each of `calls`; raises the first failure, named."""
        error = None
        for call in calls:
            try:
                call()
            except Exception as e:
                error = error or e
        if error is not None and (named := self._named(error, None)) is not None:
            raise named from error
        self.finished()

    def _named(self, e: BaseException, current: int | None) -> Exception | None:
        """The error naming a failed save's step (found by `current`'s save, or by a
        wait), once; wakes what is left of it (`release`). `None` if raised already."""
        self.finished()
        if str(e) in self.reported:
            return None
        self.reported.add(str(e))
        with self.lock:
            failed = sorted(s for s in self.steps if s != current)
            if not failed and current is not None:
                failed = [current]
            # `current` is not pending yet where its own save raised (no background).
            operations = [self.steps.pop(s)[2] for s in failed if s in self.steps]
            if current in self.steps:
                del self.steps[current]
        for operation in operations:
            release(operation)
        where, also = f"a step to {self.directory}", ""
        if failed:
            where = f"step {failed[0]} to {self.directory / str(failed[0])}"
        if current is not None and failed[0] != current:
            also = f" (so step {current} was not saved)"
        message = (
            f"The save of {where} failed{also}: {type(e).__name__}: {e}. The steps "
            f"saved before it are complete and restorable."
        )
        return _error(e, message)


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
