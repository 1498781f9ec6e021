"""What happens when a save fails or is interrupted: what it left beside its path is
finished or removed (`tidy`); its error names the checkpoint, with the system's error
number (`failed_save`, `save_error`); a `CheckpointManager` names a failed step once
and wakes what is left of its save (`Pending.failed`); and managers left open are
closed at exit (`OPEN`), where a failed background save would otherwise hang."""

import atexit
import errno
import logging
import os
import pathlib
import shutil
import threading
import time

import jax

from .orbax import release


logger = logging.getLogger("equinox_shard")
# `overwrite=True` writes the new checkpoint beside `path` (`SWAP`), then swaps it in,
# moving the old one aside (`OLD`).
SWAP = ".eqxs-overwrite"
OLD = ".eqxs-old"


def sibling(path: pathlib.Path, suffix: str) -> pathlib.Path:
    return path.with_name(path.name + suffix)


def tidy(path: pathlib.Path) -> None:
    """Finishes or removes what an interrupted save to `path` left beside it."""
    if not path.parent.is_dir():
        return
    swap, old = sibling(path, SWAP), sibling(path, OLD)
    if not path.exists() and swap.is_dir() and old.is_dir():
        os.rename(swap, path)  # killed between the two renames: `swap` is complete
    for p in path.parent.iterdir():
        if p.name.startswith(
            (path.name + ".orbax-checkpoint-tmp", swap.name, old.name)
        ):
            shutil.rmtree(p, ignore_errors=True)


def save_error(e: BaseException, message: str) -> Exception:
    """An `OSError` with the `errno` of `e` (an `OSError`, or a TensorStore error
    that says one), else a `RuntimeError`, saying `message`."""
    code = e.errno if isinstance(e, OSError) else None
    for known in (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EDQUOT):
        code = code or (known if os.strerror(known) in str(e) else None)
    return OSError(code, message) if code else RuntimeError(message)


def failed_save(e: BaseException, path: pathlib.Path) -> Exception:
    """The error of `save` to `path` failing with `e`, once what it wrote is removed
    (a checkpoint that `overwrite` was to replace stays)."""
    if jax.process_index() == 0:
        tidy(path)
    return save_error(e, f"The save to {path} failed: {type(e).__name__}: {e}")


class Pending:
    """A `CheckpointManager`'s saves started and not yet logged: each is logged once
    its step directory is final, or named once if it fails."""

    def __init__(self, directory: pathlib.Path):
        self.directory = directory
        # step -> (bytes, start, orbax's operation).
        self.steps: dict[int, tuple[int, float, str]] = {}
        self.lock = threading.Lock()
        self.reported: set[str] = set()

    def add(self, step: int, size: int, start: float, operation: str) -> None:
        with self.lock:
            self.steps[step] = (size, start, operation)

    def finished(self) -> None:
        """Logs each step started whose directory is final (orbax renames it when
        complete): called by orbax once a save is finalised, and after a save."""
        with self.lock:
            done = [s for s in self.steps if (self.directory / str(s)).is_dir()]
            for step in sorted(done):
                size, start, _ = self.steps.pop(step)
                logger.info(
                    "saved step %d to %s: %d bytes in %.2f s",
                    step, self.directory / str(step), size,
                    time.perf_counter() - start,
                )  # fmt: skip

    def failed(self, e: BaseException, current: int | None) -> Exception | None:
        """The error for a save that failed (found by orbax when `current`'s save
        started, or by a wait): it names the step it belongs to and its directory.
        Wakes what is left of that save in the background (see `release`). `None`
        if that failure was raised already (orbax raises it again)."""
        self.finished()
        if str(e) in self.reported:
            return None
        self.reported.add(str(e))
        with self.lock:
            failed = sorted(s for s in self.steps if s != current)
            if not failed and current is not None:
                failed = [current]
            operations = [self.steps.pop(s)[2] for s in failed]
            self.steps.pop(current, None)  # type: ignore[arg-type]
        for operation in operations:
            release(operation)
        step = failed[0] if failed else current
        where = f"a step to {self.directory}"
        if step is not None:
            where = f"step {step} to {self.directory / str(step)}"
        also = ""
        if current is not None and step != current:
            also = f" (so step {current} was not saved)"
        message = (
            f"The save of {where} failed{also}: {type(e).__name__}: {e}. The steps "
            f"saved before it are complete and restorable."
        )
        return save_error(e, message)


def _close_all() -> None:
    for manager in list(OPEN):
        try:
            manager.close()
        except Exception:
            logger.exception("closing the CheckpointManager of %s", manager.directory)


# Managers not closed yet (held: one dropped unclosed still has saves to finish),
# closed before the interpreter joins orbax's non-daemon threads (`atexit` runs after
# that join, which a failed save's threads would hang).
OPEN: set = set()
getattr(threading, "_register_atexit", atexit.register)(_close_all)
