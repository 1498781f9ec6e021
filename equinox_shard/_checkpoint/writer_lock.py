"""A `CheckpointManager`'s writer lock: the file `LOCK_FILE` in its directory, `flock`ed
while the manager is open, which `save` asks about before writing there."""

import contextlib
import errno
import logging
import os
import pathlib
import socket

import jax


logger = logging.getLogger("equinox_shard")


LOCK_FILE = ".eqxs-writer"  # a `CheckpointManager`'s writer lock, in its directory


def raise_if_locked(path: pathlib.Path) -> None:
    """Raises if a `CheckpointManager` of any process writes to `path`'s directory."""
    try:
        import fcntl  # POSIX only, as the lock

        fd = os.open(path.parent / LOCK_FILE, os.O_RDONLY)
    except (ImportError, OSError):
        return  # no writer's lock there
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        if _dead(os.read(fd, 256).decode(errors="replace").split()):
            return  # held only by what a dead writer left: as `take_lock` sees it
        raise RuntimeError(
            f"A CheckpointManager writes to {path.parent} (it holds its lock "
            f"{path.parent / LOCK_FILE}); `save` there would add or replace its steps "
            "behind its back, so it is refused. Save with the manager "
            "(`manager.save(step, tree, force=True)`), or elsewhere."
        ) from None
    finally:
        os.close(fd)


def _dead(owner: list[str]) -> bool:
    """Whether the lock file's `pid host` names a process of this host that is gone."""
    if len(owner) != 2 or owner[1] != socket.gethostname() or not owner[0].isdigit():
        return False
    try:
        os.kill(int(owner[0]), 0)
    except ProcessLookupError:
        return True
    except OSError:  # EPERM: it exists
        return False
    return False


@contextlib.contextmanager
def _guard(directory: pathlib.Path):
    """The directory `flock`ed: one process at a time replaces a dead writer's lock."""
    import fcntl

    fd = os.open(directory, os.O_RDONLY)
    try:
        with contextlib.suppress(OSError):  # no `flock` on directories here: unguarded
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases it


def take_lock(directory: pathlib.Path) -> int | OSError | None:
    """The open lock file, `flock`ed (the system releases it once no process has it
    open); an `OSError` where `directory` cannot be written; `None` but on process 0.
    A lock held only by the children of a writer that died is replaced."""
    import fcntl  # POSIX only: imported here so that the package imports anywhere

    if jax.process_index() != 0:
        return None
    lock = directory / LOCK_FILE
    while True:
        try:
            fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o644)
        except OSError as e:
            if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                return e  # no writer there: `save` raises, naming it
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.read(fd, 256).decode(errors="replace").split()
            if _dead(owner):
                # A child it forked (or any process given the file) keeps it locked.
                with _guard(directory):
                    if _same(fd, lock):
                        os.unlink(lock)
                os.close(fd)
                continue
            os.close(fd)
            who = "another process"
            if len(owner) == 2:
                who = f"process {owner[0]} on host {owner[1]}"
            if owner == [str(os.getpid()), socket.gethostname()]:
                who = "another CheckpointManager of this process (close it first)"
            raise RuntimeError(
                f"Another CheckpointManager writes to {directory}: {who} holds its "
                f"lock {lock}. Two writers on one directory overwrite and delete each "
                "other's steps, so this one is refused."
            ) from None
        # Locked, unless its closing writer unlinked that file meanwhile: lock anew.
        if _same(fd, lock):
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()} {socket.gethostname()}".encode())
            return fd
        os.close(fd)


def _same(fd: int, lock: pathlib.Path) -> bool:
    """Whether the file open as `fd` is still the one at `lock`."""
    return os.path.exists(lock) and os.path.samestat(os.fstat(fd), os.stat(lock))


def drop_lock(directory: pathlib.Path, fd: int) -> None:
    """Releases the lock; a lock file that cannot be removed is logged and left."""
    try:
        (directory / LOCK_FILE).unlink()
    except OSError as e:
        logger.warning(
            "could not remove the writer's lock %s of %s (%s: %s); it is released.",
            directory / LOCK_FILE, directory, type(e).__name__, e,
        )  # fmt: skip
    os.close(fd)
