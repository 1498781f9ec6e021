"""What happens when a save fails or is interrupted: what it left is finished or removed
(`tidy`); a failed `save` raises naming its path (`named`); a failed save of a
`CheckpointManager` raises once, naming its step (`save`, `wait`). Each error is an
`OSError` with the system's error number where there is one."""

import contextlib
import errno
import os
import pathlib
import shutil
from collections.abc import Callable, Iterator
from typing import Any

import jax

from .orbax import release
from .overwrite import found, OLD, SWAP


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
    """An `OSError` with the `errno` of `e` (or that its message says), else a
    `RuntimeError`."""
    code = e.errno if isinstance(e, OSError) else None
    for known in (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EDQUOT):
        code = code or (known if os.strerror(known) in str(e) else None)
    return OSError(code, message) if code else RuntimeError(message)


@contextlib.contextmanager
def named(path: pathlib.Path) -> Iterator[None]:
    """Raises a failure of the save to `path` naming it, once its writing is removed."""
    try:
        yield
    except Exception as e:
        if jax.process_index() == 0:
            tidy(path)
        raise _error(e, f"The save to {path} failed: {type(e).__name__}: {e}") from e


def save(pending: Any, save: Callable[..., bool], step: int, **kwargs) -> bool:
    """orbax's `save(step, **kwargs)`; raises the failure of an earlier save, named."""
    try:
        return save(step, **kwargs)
    except Exception as e:
        if (error := _named(pending, e, step)) is not None:
            raise error from e
    # orbax raised again (once per thread) a failure named already: save once more.
    try:
        return save(step, **kwargs)
    except Exception as e:
        raise (_named(pending, e, step) or e) from e


def wait(pending: Any, *calls: Callable[[], object]) -> None:
    """Calls each of `calls`; raises the first failure, named."""
    error = None
    for call in calls:
        try:
            call()
        except Exception as e:
            error = error or e
    if error is not None and (named := _named(pending, error, None)) is not None:
        raise named from error
    pending.finished()


def _named(pending: Any, e: BaseException, current: int | None) -> Exception | None:
    """The error for a failed save (found when `current`'s save started, or by a
    wait), naming its step; wakes what is left of it (`release`). `None` if that
    failure was raised already (orbax raises it again)."""
    pending.finished()
    if str(e) in pending.reported:
        return None
    pending.reported.add(str(e))
    with pending.lock:
        failed = sorted(s for s in pending.steps if s != current)
        if not failed and current is not None:
            failed = [current]
        # `current` is not pending yet where its own save raised (no background).
        operations = [pending.steps.pop(s)[2] for s in failed if s in pending.steps]
        pending.steps.pop(current, None)
    for operation in operations:
        release(operation)
    where, also = f"a step to {pending.directory}", ""
    if failed:
        where = f"step {failed[0]} to {pending.directory / str(failed[0])}"
    if current is not None and failed[0] != current:
        also = f" (so step {current} was not saved)"
    message = (
        f"The save of {where} failed{also}: {type(e).__name__}: {e}. The steps "
        f"saved before it are complete and restorable."
    )
    return _error(e, message)
