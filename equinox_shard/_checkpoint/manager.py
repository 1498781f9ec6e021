"""`CheckpointManager`: orbax's own, given the format of `save`/`restore`, their
`like`/`shardings` language, one writer per directory (its lock), errors naming the
step, and what becomes of it at exit and at fork (docs/checkpoints.md)."""

import atexit
import concurrent.futures.thread  # noqa: F401 (its exit hook registered before ours)
import contextlib
import os
import pathlib
import sys
import threading
import time
from typing import Any

import numpy as np
from jaxtyping import PyTree

from . import manifest
from .failures import Pending
from .orbax import composite, handlers, orbax as _orbax
from .save_restore import absolute_path, logger, nbytes, restore_from
from .writer_lock import drop_lock, take_lock


def _positive(name: str, value: Any, types: type | tuple[type, ...]) -> None:
    if value is not None and (
        not isinstance(value, types) or isinstance(value, bool) or value <= 0
    ):
        raise ValueError(f"`{name}` must be a positive number or None, not {value!r}.")


def _step(step: Any) -> int:
    if isinstance(step, (bool, np.bool_)) or not isinstance(step, (int, np.integer)):
        raise TypeError(
            "`step` must be a non-negative int (a Python or NumPy integer), not "
            f"{step!r} of type {type(step).__name__}."
        )
    if step < 0:
        raise ValueError(f"`step` must be a non-negative int, not {step}.")
    return int(step)


class CheckpointManager:
    """The checkpoints of a training loop, one per step, on orbax-checkpoint's
    `CheckpointManager`: save every N steps and/or T minutes, in the background; keep
    the last K and every M-th; resume from the latest complete one, on any layout.

    Each checkpoint is `directory/<step>`, as [`equinox_shard.save`][] writes it; a
    save killed at any moment is never listed. One manager writes to a directory at
    a time: it holds the lock file `directory/.eqxs-writer` until `close()`. A manager
    left open is closed when the program exits, however it ends, once its saves are
    complete (a save that fails then makes the process exit with status 1). A forked
    child's copy of a manager is closed, leaving the lock to its parent.

    **Arguments:**

    - `directory`: where the step directories go (created if needed). In a
        multi-process program every process creates a manager on the same directory,
        and calls `save` and `restore` with the same steps.
    - `every_steps`: `should_save(step)` is true when `step` is a multiple of it.
    - `every_minutes`: `should_save(step)` is true when this long has passed since
        the latest checkpoint, and no save is running. With neither, every step is
        saved.
    - `keep_last`: keep the latest `keep_last` checkpoints...
    - `keep_every`: ...and every checkpoint whose step is a multiple of it. With
        neither, every checkpoint is kept.
    - `background`: write in the background (see `save`). `False`: `save` returns
        once the checkpoint is complete.

    **Raises:**

    Before anything is written: `NotADirectoryError` if `directory` is a file;
    `RuntimeError` naming the process that holds the directory's lock.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        every_steps: int | None = None,
        every_minutes: int | float | None = None,
        keep_last: int | None = None,
        keep_every: int | None = None,
        background: bool = True,
    ):
        ocp = _orbax()
        from orbax.checkpoint import checkpoint_managers as cm

        _positive("every_steps", every_steps, int)
        _positive("every_minutes", every_minutes, (int, float))
        _positive("keep_last", keep_last, int)
        _positive("keep_every", keep_every, int)
        self.directory = absolute_path(directory)
        self._pending = Pending(self.directory)
        if os.path.lexists(self.directory) and not self.directory.is_dir():
            raise NotADirectoryError(
                f"{self.directory} is a file, not a directory: a CheckpointManager "
                "keeps its checkpoints in a directory (one per step)."
            )
        when: list = [cm.FixedIntervalPolicy(every_steps)] if every_steps else []
        if every_minutes is not None:
            seconds = max(1, round(every_minutes * 60))
            when.append(cm.ContinuousCheckpointingPolicy(minimum_interval_secs=seconds))
        keep: list = [cm.LatestN(keep_last)] if keep_last else []
        keep += [cm.EveryNSteps(keep_every)] if keep_every else []
        logged = ocp.AsyncOptions(post_finalization_callback=self._pending.finished)
        options = ocp.CheckpointManagerOptions(
            save_decision_policy=cm.AnySavePolicy(when or [cm.FixedIntervalPolicy(1)]),
            preservation_policy=cm.AnyPreservationPolicy(keep) if keep else None,
            enable_async_checkpointing=background,
            # orbax refuses this callback unless it saves in the background.
            async_options=logged if background else None,
            cleanup_tmp_directories=True,
        )
        self._background = background
        self.directory.mkdir(parents=True, exist_ok=True)
        lock = take_lock(self.directory)
        self._lock = lock if isinstance(lock, int) else None
        self._read_only = lock if isinstance(lock, OSError) else None
        try:
            self._manager = ocp.CheckpointManager(
                self.directory, options=options, item_handlers=handlers(ocp)
            )
        except BaseException:
            if self._lock is not None:
                drop_lock(self.directory, self._lock)
            raise
        self._closed, self._parent = False, None
        _OPEN.add(self)

    def _check_open(self, what: str) -> None:
        if self._parent is not None:
            raise RuntimeError(
                f"`{what}` on a CheckpointManager (of {self.directory}) that this "
                f"process inherited when process {self._parent} forked it: the "
                "manager stays its parent's, the one writer of its directory. Save "
                "and restore in the parent, or in another directory."
            )
        if self._closed:
            raise RuntimeError(
                f"`{what}` on a closed CheckpointManager (of {self.directory}); create "
                "a new one."
            )

    def __reduce__(self):
        # What multiprocessing's spawn and forkserver do with a child's arguments.
        raise TypeError(
            f"A CheckpointManager cannot be passed to another process (pickled, as "
            "multiprocessing's spawn does with a child's arguments): it holds the "
            f"writer lock of {self.directory} and orbax's threads in this one. Pass "
            "the directory, and open a CheckpointManager on it in the child; that is "
            "refused while this one is open, so close it first (or save and restore "
            "here)."
        )

    def _forked(self, parent: int) -> None:
        """In a forked child: closed, without waiting, removing or releasing a thing
        (its lock is the parent's while any process has the file open)."""
        self._closed, self._parent = True, parent
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def should_save(self, step: Any) -> bool:
        """Whether the policies save `step` (never one at or before the latest)."""
        self._check_open("should_save")
        return self._manager.should_save(_step(step))

    def save(self, step: Any, state: PyTree[Any], *, force: bool = False) -> bool:
        """Saves `state` as `directory/<step>` if `should_save(step)` (or `force`),
        as [`equinox_shard.save`][] does.

        In the background (the default), this returns once orbax has copied every
        shard it writes off its device, so the next step may donate `state` right
        away. A background save that fails raises at the next `save`,
        `wait_until_finished` or `close`, naming its step and directory (an `OSError`
        with the system's error number where there is one, else a `RuntimeError`).

        **Arguments:**

        - `step`: the training step, a non-negative `int` (or NumPy integer) above
            the latest saved.
        - `state`: any PyTree, as for [`equinox_shard.save`][].
        - `force`: save even if the policies would not.

        **Returns:**

        Whether a save was started.

        **Raises:**

        Before anything is written: `TypeError` if `step` is not an integer,
        `ValueError` if it is negative, or at or below the latest step and `force`
        (without `force` this returns `False`), so that `latest_step()` is always the
        checkpoint `restore()` reads; as [`equinox_shard.save`][] (naming the leaf as
        `state<key path>`). `RuntimeError` on a closed manager.
        """
        self._check_open("save")
        step = _step(step)
        if not force and not self._manager.should_save(step):
            return False
        latest = self._manager.latest_step()
        if latest is not None and step <= latest:
            raise ValueError(
                f"step {step}: the latest checkpoint in {self.directory} is step "
                f"{latest}, and a step is saved only above the latest (so that "
                "`latest_step()` is always the checkpoint that `restore()` reads). "
                "To go back to an earlier step, restore it with `restore(like, "
                "step=...)` and save into a new directory."
            )
        if self._read_only is not None:
            raise OSError(
                self._read_only.errno,
                f"step {step}: cannot save to {self.directory / str(step)}: the "
                f"directory cannot be written ({self._read_only.strerror}); nothing "
                "was written.",
            )
        ocp = _orbax()
        record, arrays = manifest.build(state, "state")
        start = time.perf_counter()
        size, args = nbytes(arrays), composite(ocp, record, arrays)
        saved = self._pending.save(
            self._manager.save, step, size, args=args, force=True
        )
        if not self._background:
            self._pending.finished()
        else:
            logger.info(
                "saving step %d to %s: %d bytes, %.2f s before training resumes",
                step, self.directory / str(step), size, time.perf_counter() - start,
            )  # fmt: skip
        return saved

    def latest_step(self) -> int | None:
        """The latest step saved (or being saved by this manager), or `None`."""
        self._check_open("latest_step")
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Every step kept, in increasing order."""
        self._check_open("all_steps")
        return sorted(self._manager.all_steps())

    def wait_until_finished(self) -> None:
        """Waits for every save started; raises, naming its step, if one failed."""
        self._check_open("wait_until_finished")
        self._pending.wait(self._manager.wait_until_finished)

    def restore(
        self, like: PyTree[Any], step: Any = None, shardings: Any = None
    ) -> PyTree[Any]:
        """Restores the checkpoint of `step` (by default the latest), as
        [`equinox_shard.restore`][] does, once the saves still running are done.

        **Raises:**

        `FileNotFoundError` if there is no such checkpoint, or it is partly deleted
        (an interrupted deletion of old steps); otherwise as
        [`equinox_shard.restore`][].
        """
        self._check_open("restore")
        step = None if step is None else _step(step)
        self.wait_until_finished()
        steps = self.all_steps()
        if step is None and steps:
            step = steps[-1]
        if step not in steps:
            which = "" if step is None else f" of step {step}"
            raise FileNotFoundError(
                f"No checkpoint{which} in {self.directory} (its steps: "
                f"{', '.join(map(str, steps)) or 'none'})."
            )
        path: pathlib.Path = self.directory / str(step)
        try:
            return restore_from(path, like, shardings, f"step {step}")
        except (FileNotFoundError, ValueError) as e:
            # orbax writes this file when it finalises a step, and deletes it first.
            if (path / "_CHECKPOINT_METADATA").exists():
                raise
            raise FileNotFoundError(
                f"The checkpoint of step {step} in {self.directory} is partly deleted "
                "(a deletion of old steps by `keep_last`/`keep_every` was "
                "interrupted); the next save removes it. Its steps: "
                f"{', '.join(map(str, steps))}."
            ) from e

    def close(self) -> None:
        """Waits for the saves still running and releases the directory. Raises,
        naming its step, if a background save failed; the manager is closed either
        way. Any method but `close` of a closed manager raises `RuntimeError`."""
        if self._closed:
            return
        self._closed = True
        _OPEN.discard(self)
        try:
            self._pending.wait(self._manager.wait_until_finished, self._manager.close)
        finally:
            if self._lock is not None:
                drop_lock(self.directory, self._lock)

    def __enter__(self) -> "CheckpointManager":
        self._check_open("with")
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.close()
        except Exception:
            if exc[0] is None:
                raise
            logger.exception("closing the CheckpointManager of %s", self.directory)


def _close_all() -> None:
    """Closes the managers left open as Python exits; where a save is lost, the
    process exits with status 1 (once Python has joined its threads)."""
    lost = False
    for manager in list(_OPEN):
        try:
            manager.close()
        except Exception:  # names the step
            logger.exception("closing the CheckpointManager of %s", manager.directory)
            lost = True
        except BaseException:  # interrupted (a second Ctrl-C): the saves left are lost
            steps = ", ".join(map(str, sorted(manager._pending.steps))) or "none"
            logger.error(
                "exiting before the saves to %s were complete (steps: %s); the "
                "steps saved before them are complete and restorable.",
                manager.directory, steps,
            )  # fmt: skip
            lost = True
    if lost:
        atexit.register(_exit_lost)


def _exit_lost() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()  # pyright: ignore[reportOptionalMemberAccess]
    os._exit(1)  # a status that says a checkpoint was lost


def _fork_child() -> None:
    parent = os.getppid()
    for manager in list(_OPEN):
        manager._forked(parent)
    _OPEN.clear()


# Open managers. Python calls these exit hooks in reverse order, before it joins the
# threads of `concurrent.futures` (orbax's) and refuses them more work: saves in flight
# complete. `atexit` runs only after that.
_OPEN: set[CheckpointManager] = set()
getattr(threading, "_register_atexit", atexit.register)(_close_all)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_fork_child)
