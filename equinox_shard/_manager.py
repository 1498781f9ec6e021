"""`CheckpointManager`: the checkpoints of a training loop, on orbax's
`CheckpointManager`.

orbax does the step management: a directory per step (`directory/<step>`), written
into a temporary directory and renamed when complete (so an interrupted save is never
listed), the decision to save (`FixedIntervalPolicy`, `ContinuousCheckpointingPolicy`),
what is kept (`LatestN`, `EveryNSteps`), the writing in the background, and the removal
of temporary directories that a killed save left. This module gives it the checkpoint
format of `save`/`restore` (each step directory is exactly what `equinox_shard.save`
writes, with its record of leaves and checksums) and their `like`/`shardings` language.
"""

import os
import pathlib
import time
from typing import Any

import jax._src.traceback_util as traceback_util
from jaxtyping import PyTree

from . import _record as record_lib
from ._checkpoint import _absolute, LOCK, logger, nbytes, restore_from
from ._orbax_setup import arrays_handler, composite, orbax as _orbax


traceback_util.register_exclusion(__file__)


def _positive(name: str, value: Any, kind: type | tuple[type, ...]) -> None:
    if value is not None and (
        not isinstance(value, kind) or isinstance(value, bool) or value <= 0
    ):
        raise ValueError(f"`{name}` must be a positive number or None, not {value!r}.")


class CheckpointManager:
    """The checkpoints of a training loop in one directory, one per step, on
    orbax-checkpoint's `CheckpointManager`: save every N steps and/or every T minutes,
    in the background; keep the last K and every M-th; resume from the latest
    complete one, on any layout.

    Each checkpoint is `directory/<step>`, in the format of [`equinox_shard.save`][]
    (so [`equinox_shard.restore`][] reads it too). A save killed at any moment is
    never listed: orbax writes into a temporary directory and renames it when
    complete (and removes such leftovers when a manager is created).

    **Arguments:**

    - `directory`: where the step directories go (created if needed). In a
        multi-process program every process creates a manager on the same directory
        of a shared file system, and calls `save` and `restore` with the same steps.
    - `every_steps`: `should_save(step)` is true when `step` is a multiple of it.
    - `every_minutes`: `should_save(step)` is true when this long has passed since
        the latest checkpoint (or there is none), and no save is running.
        With neither `every_steps` nor `every_minutes`, every step is saved.
    - `keep_last`: keep the latest `keep_last` checkpoints...
    - `keep_every`: ...and every checkpoint whose step is a multiple of it. With
        neither, every checkpoint is kept.
    - `background`: write in the background (orbax's asynchronous checkpointing):
        `save` returns once every array it writes has been copied off its device
        (see `save`). `False`: `save` returns once the checkpoint is complete.
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
        self.directory = _absolute(directory)
        when: list = [cm.FixedIntervalPolicy(every_steps)] if every_steps else []
        if every_minutes is not None:
            seconds = max(1, round(every_minutes * 60))
            when.append(cm.ContinuousCheckpointingPolicy(minimum_interval_secs=seconds))
        keep: list = [cm.LatestN(keep_last)] if keep_last else []
        keep += [cm.EveryNSteps(keep_every)] if keep_every else []
        options = ocp.CheckpointManagerOptions(
            save_decision_policy=cm.AnySavePolicy(when or [cm.FixedIntervalPolicy(1)]),
            preservation_policy=cm.AnyPreservationPolicy(keep) if keep else None,
            enable_async_checkpointing=background,
            async_options=ocp.AsyncOptions(post_finalization_callback=self._finished),
            cleanup_tmp_directories=True,
            create=True,
        )
        self._background = background
        self._pending: list[tuple[int, int, float]] = []
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=options,
            item_handlers={
                "leaves": ocp.JsonCheckpointHandler(),
                "arrays": arrays_handler(ocp),
            },
        )

    def _finished(self) -> None:
        while self._pending:
            step, size, start = self._pending.pop(0)
            logger.info(
                "saved step %d to %s: %d bytes in %.2f s",
                step, self.directory / str(step), size, time.perf_counter() - start,
            )  # fmt: skip

    def should_save(self, step: int) -> bool:
        """Whether the policies (`every_steps`, `every_minutes`) save `step`: never a
        step at or before the latest checkpoint."""
        return self._manager.should_save(step)

    def save(self, step: int, state: PyTree[Any], *, force: bool = False) -> bool:
        """Saves `state` as `directory/<step>` if `should_save(step)` (or `force`),
        in the format of [`equinox_shard.save`][].

        In the background (the default), this returns once orbax has copied every
        shard it writes off its device (orbax waits for those copies before
        returning), and the files are written while training goes on. So the next
        step may donate `state` right away (`filter_jit(..., donate="all")`): on an
        accelerator the saved values are already in host memory; on CPU orbax's
        host copy is a view of the device buffer, which XLA then does not donate
        (it copies instead), so the values saved are still those of `step`.

        **Arguments:**

        - `step`: the training step, an `int` above the latest saved.
        - `state`: any PyTree, as for [`equinox_shard.save`][].
        - `force`: save even if the policies would not.

        **Returns:**

        Whether a save was started.

        **Raises:**

        Before anything is written, as [`equinox_shard.save`][] (naming the leaf as
        `state<key path>`).
        """
        if not force and not self.should_save(step):
            return False
        ocp = _orbax()
        record, arrays = record_lib.build(state, "state")
        start = time.perf_counter()
        size = nbytes(arrays)
        self._pending.append((step, size, start))
        with LOCK:
            saved = self._manager.save(
                step, args=composite(ocp, record, arrays), force=True
            )
        if not self._background:
            self._finished()
        else:
            logger.info(
                "saving step %d to %s: %d bytes, %.2f s before training resumes",
                step, self.directory / str(step), size, time.perf_counter() - start,
            )  # fmt: skip
        return saved

    def latest_step(self) -> int | None:
        """The latest step saved (including one still being written in the
        background by this manager), or `None`. A save that was killed is never
        one."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Every step kept, in increasing order."""
        return sorted(self._manager.all_steps())

    def wait_until_finished(self) -> None:
        """Returns once every save started is complete (and old ones removed)."""
        self._manager.wait_until_finished()

    def restore(
        self, like: PyTree[Any], step: int | None = None, shardings: Any = None
    ) -> PyTree[Any]:
        """Restores the checkpoint of `step` (by default the latest), as
        [`equinox_shard.restore`][] does: `like` gives the structure (and, where
        `shardings` is `None`, the shardings), `shardings` any layout. It first waits
        for the saves still running.

        **Raises:**

        `FileNotFoundError` if there is no such checkpoint, or it is partly deleted
        (a deletion of old steps that was interrupted); otherwise as
        [`equinox_shard.restore`][], naming the leaf before any array is read.
        """
        self.wait_until_finished()
        steps = self.all_steps()
        if step is None:
            step = steps[-1] if steps else None
        if step is None or step not in steps:
            which = "" if step is None else f" of step {step}"
            raise FileNotFoundError(
                f"No checkpoint{which} in {self.directory} (its steps: "
                f"{', '.join(map(str, steps)) or 'none'})."
            )
        start = time.perf_counter()
        path: pathlib.Path = self.directory / str(step)
        try:
            out, read = restore_from(path, like, shardings, f"step {step}")
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
        logger.info(
            "restored step %d from %s: %d bytes in %.2f s",
            step, path, nbytes(read), time.perf_counter() - start,
        )  # fmt: skip
        return out

    def close(self) -> None:
        """Waits for the saves still running, and releases orbax's resources."""
        self._manager.close()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
