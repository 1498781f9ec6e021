"""A `CheckpointManager` at the edges of its process, each in a fresh one: a background
save still running when the program ends (however it ends) completes first; forked
children never release, remove or keep their parent's lock; a lock whose holder was
killed is taken over whoever else still has the file open."""

import functools as ft
import os
import signal
import subprocess
import sys

import equinox_shard as eqxs
import jax
import numpy as np
import pytest

from . import checkpoint_worker as worker


pytest.importorskip("orbax.checkpoint")

DEADLINE = 120  # a child that hangs is killed here (a run takes a few seconds)


def _env():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    return env


def _run(*args):
    return subprocess.run(
        [sys.executable, worker.__file__, *map(str, args)],
        capture_output=True, text=True, timeout=DEADLINE, env=_env(),
    )  # fmt: skip


@ft.cache
def _threads_start_at_exit() -> bool:
    """Whether this interpreter starts a thread from a hook run as it shuts down."""
    code = (
        "import threading\n"
        "def hook(): t = threading.Thread(target=print); t.start(); t.join()\n"
        "threading._register_atexit(hook)\n"
    )
    probe = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return "can't create new thread" not in probe.stderr


@pytest.mark.parametrize(
    "how, status",
    [("end", 0), ("exit", 3), ("raise", 1), ("interrupt", -signal.SIGINT)],
)
def test_save_in_flight_at_exit_completes(tmp_path, how, status):
    result = _run("manager-exit", tmp_path, how)
    if not _threads_start_at_exit():
        # CPython 3.12.0-3.12.2 refuse new threads once shutdown begins, and orbax
        # starts one to finish a save: the process says so and exits 1 (docs).
        assert result.returncode == 1, result.stderr[-3000:]
        assert "The save of step 0 " in result.stderr, result.stderr[-3000:]
        assert "can't create new thread at interpreter shutdown" in result.stderr
        with eqxs.CheckpointManager(tmp_path) as manager:
            assert manager.all_steps() == []
        return
    assert result.returncode == status, result.stderr[-3000:]
    assert result.stdout.splitlines() == ["SAVE True"]
    assert "cannot schedule new futures" not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0"]  # no lock, no tmp
    expected = worker.exit_state()
    like = jax.tree.map(np.asarray, expected)
    like["step"] = 0
    with eqxs.CheckpointManager(tmp_path) as manager:
        assert manager.all_steps() == [0]
        out = manager.restore(like)
    assert out["step"] == 1000
    assert np.array_equal(out["w"], np.arange(1 << 20, dtype=np.float32))


def test_forked_workers_leave_the_lock_to_their_parent(tmp_path):
    result = _run("manager-fork", tmp_path, "pool")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[1].startswith(
        f"REFUSED Another CheckpointManager writes to {tmp_path}: another "
        "CheckpointManager of this process (close it first)"
    ), lines
    assert lines[0] == f"POOL {['refused'] * 4}"
    assert list(tmp_path.iterdir()) == []  # the parent's close() removed it


@pytest.mark.parametrize("how", ["live", "inherited"])
def test_lock_of_a_killed_writer_is_free_while_its_child_lives(tmp_path, how):
    directory = tmp_path / "ckpt"
    with open(tmp_path / "stderr", "w") as stderr:
        # Not a pipe: the child that lives on would hold it open.
        trainer = subprocess.Popen(
            [sys.executable, worker.__file__, "manager-fork", str(directory), how],
            stdout=subprocess.PIPE, stderr=stderr, text=True, env=_env(),
        )  # fmt: skip
    child = None
    try:
        assert trainer.stdout is not None
        line = trainer.stdout.readline()
        assert line.startswith("FORKED "), (tmp_path / "stderr").read_text()[-3000:]
        child = int(line.split()[1])
        trainer.kill()
        trainer.wait()
        os.kill(child, 0)  # alive, the lock file open
        eqxs.save(directory / "plain", {"x": np.arange(2.0)})  # nor refuses `save`
        with eqxs.CheckpointManager(directory) as manager:
            owner = (directory / ".eqxs-writer").read_text().split()[0]
            assert owner == str(os.getpid())
            manager.save(1, {"x": np.arange(4.0)})
        assert sorted(p.name for p in directory.iterdir()) == ["1", "plain"]
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        if child is not None:
            os.kill(child, signal.SIGKILL)
        trainer.stdout.close()  # pyright: ignore[reportOptionalMemberAccess]
