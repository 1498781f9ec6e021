"""`CheckpointManager` and `save`/`restore` when things go wrong: a failed background
save (read-only, full disk) raises naming its step and never hangs the process; steps
are non-negative ints, never saved again at or below the latest; a closed manager, a
path that is a file, a second writer, a directory that is not a checkpoint, damaged
metadata: each a clear error before anything is written or read."""

import contextlib
import errno
import json
import logging
import os
import re
import signal
import subprocess
import sys

import equinox_shard as eqxs
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from . import checkpoint_worker as worker
from .helpers import assert_same_values, snapshot


pytest.importorskip("orbax.checkpoint")

# A child process that hangs is killed here (a run takes a few seconds).
DEADLINE = 120


def _env():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    return env


def _fails(tmp_path, call):
    try:
        result = subprocess.run(
            [sys.executable, worker.__file__, "manager-fails", str(tmp_path), call],
            capture_output=True, text=True, timeout=DEADLINE, env=_env(),
        )  # fmt: skip
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout
        pytest.fail(f"the process hung at exit after a failed save; printed: {out}")
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.splitlines()


def test_failed_background_save_does_not_hang(tmp_path):
    lines = _fails(tmp_path, "wait")
    assert lines[0] == "SAVE True"
    path = tmp_path / "3"
    assert lines[1].startswith(
        f"WAIT OSError [Errno {errno.EROFS}] The save of step 3 to {path} failed: "
    ), lines
    assert lines[2:] == ["EXITING"]


@pytest.mark.slow
def test_failed_background_save_raised_by_close(tmp_path):
    lines = _fails(tmp_path, "close")
    assert lines[1].startswith(
        f"CLOSE OSError [Errno {errno.EROFS}] The save of step 3 to {tmp_path / '3'} "
    ), lines
    assert lines[2:] == ["EXITING"]
    with eqxs.CheckpointManager(tmp_path) as manager:
        assert manager.all_steps() == [1]


@pytest.mark.slow
def test_failed_background_save_raised_by_close_on_a_read_only_directory(tmp_path):
    # The lock file cannot be removed either: still the step's error, and no hang.
    lines = _fails(tmp_path, "close-read-only")
    assert lines[0] == "SAVE True"
    assert lines[1].startswith(
        f"CLOSE OSError [Errno {errno.EROFS}] The save of step 3 to {tmp_path / '3'} "
    ), lines
    assert lines[2:] == ["EXITING"]


@pytest.mark.slow
def test_failed_background_save_and_no_close(tmp_path):
    # Neither waited for nor closed: the manager is closed as the program exits,
    # which logs the failure, and the process exits with status 1 (a step was lost).
    try:
        result = subprocess.run(
            [sys.executable, worker.__file__, "manager-fails", str(tmp_path), "none"],
            capture_output=True, text=True, timeout=DEADLINE, env=_env(),
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail("the process hung at exit after a failed save")
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stdout.splitlines() == ["SAVE True", "EXITING"]
    assert f"The save of step 3 to {tmp_path / '3'} failed" in result.stderr


@contextlib.contextmanager
def _small_disk(path, size="256k"):
    """A tmpfs of `size` at `path` where this machine lets us mount one (as root),
    else `None`."""
    path.mkdir()
    try:
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
            capture_output=True,
        ).returncode == 0  # fmt: skip
    except OSError:  # no `mount`
        mounted = False
    try:
        yield path if mounted else None
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], check=True)


def _full_disk_patch(monkeypatch, name="/2."):
    # No tmpfs to fill: a step's directory cannot be created, as on a full disk.
    mkdir = os.mkdir

    def full(path, *args, **kwargs):
        if "orbax-checkpoint-tmp" in os.fspath(path) and name in os.fspath(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(path))
        return mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", full)


def test_full_disk_raises_naming_the_step(tmp_path, caplog, monkeypatch):
    small = {"x": jnp.arange(16.0)}
    big = {"x": jnp.asarray(np.random.default_rng(0).standard_normal(1 << 17))}
    with _small_disk(tmp_path / "disk") as disk:
        directory = (disk or tmp_path) / "run"
        manager = eqxs.CheckpointManager(directory)
        if disk is None:
            _full_disk_patch(monkeypatch)
        with caplog.at_level(logging.INFO, logger="equinox_shard"):
            assert manager.save(1, small)
            manager.wait_until_finished()
            assert manager.save(2, big)  # 1 MiB: more than the disk holds
            with pytest.raises(OSError) as info:
                manager.save(3, small)
            manager.close()
        assert info.value.errno == errno.ENOSPC
        assert str(info.value).startswith(
            f"[Errno {errno.ENOSPC}] The save of step 2 to {directory / '2'} failed "
            "(so step 3 was not saved): "
        ), str(info.value)
        saved = [r.getMessage().split(":")[0] for r in caplog.records]
        saved = [m for m in saved if m.startswith("saved")]
        assert saved == [f"saved step 1 to {directory / '1'}"], saved
        with eqxs.CheckpointManager(directory) as manager:
            assert manager.latest_step() == 1
            assert_same_values(manager.restore(small), snapshot(small))


def test_failed_save_closed_by_a_with_block_that_raises(tmp_path, caplog, monkeypatch):
    # The block's own exception goes on; the save's failure is logged, naming the
    # manager's directory and the step.
    small = {"x": jnp.arange(16.0)}
    _full_disk_patch(monkeypatch)
    with caplog.at_level(logging.INFO, logger="equinox_shard"):
        with pytest.raises(KeyError, match="the block's own"):
            with eqxs.CheckpointManager(tmp_path) as manager:
                assert manager.save(2, small)
                raise KeyError("the block's own")
    monkeypatch.undo()
    (record,) = [
        r
        for r in caplog.records
        if r.name == "equinox_shard" and r.levelno >= logging.ERROR
    ]
    assert record.getMessage() == f"closing the CheckpointManager of {tmp_path}"
    assert record.exc_info is not None
    assert str(record.exc_info[1]).startswith(
        f"[Errno {errno.ENOSPC}] The save of step 2 to {tmp_path / '2'} failed: "
    ), str(record.exc_info[1])


def test_save_on_a_full_disk(tmp_path, monkeypatch):
    small = {"x": jnp.arange(16.0)}
    big = {"x": jnp.asarray(np.random.default_rng(0).standard_normal(1 << 17))}
    with _small_disk(tmp_path / "disk") as disk:
        root = disk or tmp_path / "disk"
        eqxs.save(root / "ckpt", small)
        if disk is None:
            _full_disk_patch(monkeypatch, "")
        for path, overwrite in ((root / "new", False), (root / "ckpt", True)):
            with pytest.raises(OSError) as info:
                eqxs.save(path, big, overwrite=overwrite)
            assert info.value.errno == errno.ENOSPC
            assert str(info.value).startswith(
                f"[Errno {errno.ENOSPC}] The save to {path} failed: "
            ), str(info.value)
        # Nothing left of the failed saves; the old checkpoint intact.
        assert sorted(p.name for p in root.iterdir()) == ["ckpt"]
        assert_same_values(eqxs.restore(root / "ckpt", small), snapshot(small))


def test_read_only_directory(tmp_path):
    with _small_disk(tmp_path / "disk") as disk:
        if disk is None:
            pytest.skip("no read-only file system to mount here")
        eqxs.save(disk / "run" / "1", {"x": jnp.ones(3)})
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        with eqxs.CheckpointManager(disk / "run") as manager:
            assert manager.latest_step() == 1  # it reads
            with pytest.raises(OSError, match=r"step 2: cannot save to .*run/2: the "):
                manager.save(2, {"x": jnp.ones(3)})
            assert manager.all_steps() == [1]


@pytest.mark.parametrize(
    "step, error, message",
    [
        (2.5, TypeError, r"`step` must be a non-negative int .* not 2.5 of type float"),
        (7.0, TypeError, r"not 7.0 of type float"),
        (np.float32(3), TypeError, r"not (np.float32\()?3.0\)? of type float32"),
        (True, TypeError, r"not True of type bool"),
        ("5", TypeError, r"not '5' of type str"),
        (-1, ValueError, r"`step` must be a non-negative int, not -1"),
        (np.int64(-2), ValueError, r"not -2"),
    ],
)
def test_step_is_a_non_negative_int(tmp_path, step, error, message):
    with eqxs.CheckpointManager(tmp_path, keep_last=2) as manager:
        with pytest.raises(error, match=message):
            manager.save(step, {"x": jnp.ones(2)}, force=True)
        with pytest.raises(error, match=message):
            manager.should_save(step)
        with pytest.raises(error, match=message):
            manager.restore({"x": jnp.ones(2)}, step=step)
        assert manager.save(np.int32(4), {"x": jnp.ones(2)})  # a NumPy integer
        manager.wait_until_finished()
        assert manager.all_steps() == [4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["4"]


def test_a_step_at_or_below_the_latest_is_refused(tmp_path):
    states = {s: {"x": jnp.full(3, float(s)), "n": s} for s in (10, 15, 20)}
    with eqxs.CheckpointManager(tmp_path, keep_last=2) as manager:
        manager.save(10, states[10])
        manager.save(20, states[20])
        for step in (15, 20):
            with pytest.raises(
                ValueError, match=rf"step {step}: the latest .* step 20"
            ):
                manager.save(step, states[15], force=True)
        assert not manager.save(15, states[15])  # the policy: not above the latest
        assert manager.latest_step() == 20
        out = manager.restore(states[10])
        assert out["n"] == 20
        assert_same_values(out, snapshot(states[20]))
        assert manager.all_steps() == [10, 20]


def test_closed_manager(tmp_path):
    manager = eqxs.CheckpointManager(tmp_path)
    manager.save(1, {"x": jnp.ones(2)})
    manager.close()
    manager.close()  # twice is fine
    for name, call in (
        ("save", lambda: manager.save(2, {"x": jnp.ones(2)})),
        ("restore", lambda: manager.restore({"x": jnp.ones(2)})),
        ("latest_step", manager.latest_step),
        ("all_steps", manager.all_steps),
        ("should_save", lambda: manager.should_save(3)),
        ("wait_until_finished", manager.wait_until_finished),
        ("with", manager.__enter__),
    ):
        # Naming the method called.
        match = rf"^`{name}` on a closed CheckpointManager \(of "
        with pytest.raises(RuntimeError, match=match):
            call()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1"]


def test_manager_on_a_file(tmp_path):
    file = tmp_path / "ckpt"
    file.write_text("mine")
    with pytest.raises(NotADirectoryError, match=r"ckpt is a file, not a directory"):
        eqxs.CheckpointManager(file)
    assert file.read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_second_writer_in_one_process(tmp_path):
    with eqxs.CheckpointManager(tmp_path) as manager:
        manager.save(1, {"x": jnp.ones(2)})
        with pytest.raises(RuntimeError, match="another CheckpointManager of this"):
            eqxs.CheckpointManager(tmp_path)
    with eqxs.CheckpointManager(tmp_path) as manager:  # closed: free again
        assert manager.all_steps() == [1]


def test_second_writer_through_a_symbolic_link(tmp_path):
    real, link = tmp_path / "real", tmp_path / "link"
    real.mkdir()
    link.symlink_to(real)
    with eqxs.CheckpointManager(real) as manager:
        manager.save(1, {"x": jnp.ones(2)})
        with pytest.raises(RuntimeError, match="another CheckpointManager of this"):
            eqxs.CheckpointManager(link)
        manager.wait_until_finished()
        assert manager.all_steps() == [1]
    assert sorted(p.name for p in real.iterdir()) == ["1"]
    with eqxs.CheckpointManager(link) as manager:  # closed: free again, by any name
        with pytest.raises(RuntimeError, match="another CheckpointManager of this"):
            eqxs.CheckpointManager(real)
        assert manager.all_steps() == [1]


@pytest.mark.parametrize("through", ["directory", "symbolic link"])
def test_save_into_a_managed_directory_is_refused(tmp_path, through):
    # Found by the new-user trial: `eqxs.save` into a live manager's directory added
    # or replaced steps behind its back (a foreign step became the latest).
    real = tmp_path / "real"
    real.mkdir()
    root = real
    if through == "symbolic link":
        root = tmp_path / "link"
        root.symlink_to(real)
    with eqxs.CheckpointManager(real) as manager:
        manager.save(1, {"x": jnp.ones(2)})
        manager.wait_until_finished()
        for step, overwrite in ((50, False), (1, True)):
            with pytest.raises(RuntimeError, match=r"A CheckpointManager writes to"):
                eqxs.save(root / str(step), {"x": jnp.zeros(2)}, overwrite=overwrite)
        assert manager.all_steps() == [1]
        restored = manager.restore({"x": jax.ShapeDtypeStruct((2,), jnp.float32)}, 1)
        np.testing.assert_array_equal(restored["x"], np.ones(2, np.float32))
    assert sorted(p.name for p in real.iterdir()) == ["1"]
    eqxs.save(root / "50", {"x": jnp.zeros(2)})  # closed: free again
    assert sorted(p.name for p in real.iterdir()) == ["1", "50"]


def _writer(directory):
    return subprocess.Popen(
        [sys.executable, worker.__file__, "manager-writer", str(directory)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env(),
    )  # fmt: skip


@pytest.mark.slow
def test_second_writer_in_another_process(tmp_path):
    first = _writer(tmp_path)
    try:
        assert first.stdout is not None and first.stdin is not None
        assert first.stdout.readline() == "LOCKED\n"
        second = _writer(tmp_path)
        out, _ = second.communicate(timeout=DEADLINE)
        assert out.startswith(
            f"REFUSED RuntimeError Another CheckpointManager writes to {tmp_path}: "
            f"process {first.pid} on host "
        ), out
        assert sorted(p.name for p in tmp_path.iterdir()) == [".eqxs-writer"]
        first.send_signal(signal.SIGKILL)  # its lock stays, naming a dead process
        first.communicate()
        third = _writer(tmp_path)
        assert third.stdout is not None
        assert third.stdout.readline() == "LOCKED\n"
        third.communicate("", timeout=DEADLINE)
        assert third.returncode == 0
    finally:
        if first.poll() is None:
            first.kill()
            first.communicate()
    assert list(tmp_path.iterdir()) == []  # released by close()


def test_overwrite_refuses_what_is_not_a_checkpoint(tmp_path):
    file = tmp_path / "a_file"
    file.write_text("mine")
    with pytest.raises(FileExistsError, match=r"a_file is a file, not a checkpoint"):
        eqxs.save(file, {"x": jnp.ones(2)}, overwrite=True)
    assert file.read_text() == "mine"
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"folder is a directory that is not a"):
        eqxs.save(folder, {"x": jnp.ones(2)}, overwrite=True)
    assert [p.name for p in folder.iterdir()] == ["notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "folder"]
    # An empty directory, or a checkpoint, is replaced.
    (tmp_path / "empty").mkdir()
    eqxs.save(tmp_path / "empty", {"x": jnp.ones(2)}, overwrite=True)
    eqxs.save(tmp_path / "empty", {"x": jnp.zeros(2)}, overwrite=True)
    out = eqxs.restore(tmp_path / "empty", {"x": jnp.ones(2)})
    np.testing.assert_array_equal(np.asarray(out["x"]), 0.0)


def test_save_refuses_a_symbolic_link(tmp_path):
    eqxs.save(tmp_path / "ckpt", {"x": jnp.ones(2)})
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "ckpt")
    for overwrite in (False, True):
        with pytest.raises(
            FileExistsError, match=rf"{re.escape(str(link))} is a symbolic link \(to "
        ):
            eqxs.save(link, {"x": jnp.zeros(2)}, overwrite=overwrite)
    assert link.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "link"]
    out = eqxs.restore(link, {"x": jnp.zeros(2)})  # read through it
    np.testing.assert_array_equal(np.asarray(out["x"]), 1.0)
    eqxs.save(tmp_path / "ckpt", {"x": jnp.zeros(2)}, overwrite=True)
    out = eqxs.restore(link, {"x": jnp.ones(2)})
    np.testing.assert_array_equal(np.asarray(out["x"]), 0.0)


def _both_restores_raise(path, state, message: str) -> None:
    # `restore` of step 1, and `CheckpointManager.restore` of the latest: one error.
    with pytest.raises(ValueError, match=message):
        eqxs.restore(path / "1", state)
    with eqxs.CheckpointManager(path) as manager:
        with pytest.raises(ValueError, match=message):
            manager.restore(state)


@pytest.mark.parametrize("file", ["leaves/metadata", "arrays/_METADATA"])
def test_damaged_json_metadata(tmp_path, file):
    state = {"x": jnp.ones(3), "n": 1}
    with eqxs.CheckpointManager(tmp_path) as manager:
        manager.save(1, state)
    damaged = tmp_path / "1" / file
    damaged.write_text(damaged.read_text()[:-7])
    message = (
        rf"The checkpoint at {tmp_path / '1'} is damaged: its metadata file "
        rf"{damaged} is not valid JSON \("
    )
    _both_restores_raise(tmp_path, state, message)


def _leaf(name):
    def change(record, edit):
        [entry] = [e for e in record["leaves"] if e["path"] == name]
        edit(entry)
        return record

    return change


@pytest.mark.parametrize(
    "file, change, why",
    [
        ("arrays/_METADATA", lambda m: [], r"holds a JSON list, not a JSON object"),
        ("arrays/_METADATA", lambda m: None, r"holds null, not a JSON object"),
        ("arrays/_METADATA", lambda m: {}, r"is not as orbax writes it \(KeyError: "),
        ("leaves/metadata", lambda m: [], r"holds a JSON list, not a JSON object"),
        ("leaves/metadata", lambda m: {}, r"it has no 'format'"),
        (
            "leaves/metadata",
            lambda m: {k: v for k, v in m.items() if k != "version"},
            r"it has no 'version'",
        ),
        (
            "leaves/metadata",
            lambda m: _leaf("['x']")(m, lambda e: e.pop("shape")),
            r"its leaf entry 1 \(of the leaf \['x'\]\): it has no 'shape'",
        ),
        (
            "leaves/metadata",
            lambda m: _leaf("['x']")(m, lambda e: e.pop("checksum")),
            r"\['x'\]\): it has no 'checksum'",
        ),
        (
            "leaves/metadata",
            lambda m: _leaf("['x']")(
                m, lambda e: e.update(checksum=str(e["checksum"]))
            ),
            r"\['x'\]\): its 'checksum' is '\d+', not an unsigned 32-bit integer",
        ),
        (
            "leaves/metadata",
            lambda m: _leaf("['n']")(m, lambda e: e.update(value="3")),
            r"\['n'\]\): its 'value' is '3', not a Python int",
        ),
    ],
)
def test_metadata_of_the_wrong_structure(tmp_path, file, change, why):
    # Valid JSON, not what was written: an error naming the checkpoint and the file.
    state = {"x": jnp.ones(3), "n": 3}
    eqxs.save(tmp_path / "1", state)
    damaged = tmp_path / "1" / file
    damaged.write_text(json.dumps(change(json.loads(damaged.read_text()))))
    message = (
        rf"The checkpoint at {tmp_path / '1'} is damaged: its metadata file "
        rf"{damaged} .*{why}"
    )
    _both_restores_raise(tmp_path, state, message)


def test_deleted_array_raises_as_filter_jit_does(tmp_path):
    donated = jnp.ones(3)
    donated.delete()
    with pytest.raises(RuntimeError) as placing:
        eqxs.filter_device_put({"x": donated}, jax.devices()[0])
    with pytest.raises(RuntimeError) as saving:
        eqxs.save(tmp_path / "a", {"x": donated})
    # One message, of one function (`_arrays.raise_if_deleted`), after the key path.
    placed, saved = str(placing.value), str(saving.value)
    assert saved.split(": ", 1)[1].startswith(placed.split(": ", 1)[1].split(", so")[0])
    with eqxs.CheckpointManager(tmp_path / "m") as manager:
        with pytest.raises(RuntimeError, match=r"state\['x'\]: this array has been"):
            manager.save(1, {"x": donated})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_full_disk_without_background_raises_naming_the_step(tmp_path, monkeypatch):
    small = {"x": jnp.arange(16.0)}
    directory = tmp_path / "run"
    with eqxs.CheckpointManager(directory, background=False) as manager:
        assert manager.save(1, small)
        _full_disk_patch(monkeypatch)
        with pytest.raises(OSError) as info:
            manager.save(2, small)
        assert info.value.errno == errno.ENOSPC
        assert str(info.value).startswith(
            f"[Errno {errno.ENOSPC}] The save of step 2 to {directory / '2'} failed: "
        ), str(info.value)
    monkeypatch.undo()
    with eqxs.CheckpointManager(directory) as manager:
        assert manager.all_steps() == [1]
        assert_same_values(manager.restore(small), snapshot(small))
