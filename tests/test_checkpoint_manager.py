"""`eqxs.CheckpointManager`: step directories, policies, retention, resume from the
latest on another layout, background saves racing a donating step, a save killed
midway, log lines."""

import inspect
import logging
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys

import equinox as eqx
import equinox_shard as eqxs
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from . import checkpoint_worker as worker
from .helpers import assert_same_values, auto_mesh, snapshot
from .isolated import HANG_SECONDS, killed_after_first_line
from .test_checkpoint_safety import _flip_byte_of


pytest.importorskip("orbax.checkpoint")

MATRIX = r"layers\[\d\]\.weight$"
FSDP = eqxs.PathRules([(MATRIX, P("data"))], default=P())
TWO_D = eqxs.PathRules([(MATRIX, P("data", "model"))], default=P())


def _state(seed):
    model = eqx.nn.MLP(16, 16, 64, 2, key=jax.random.key(seed))
    return {"model": model, "key": jax.random.key(seed + 1), "step": seed}


def _put(tree, mesh, rules):
    with jax.set_mesh(mesh):
        return eqxs.filter_device_put(tree, rules)


def test_step_directories_and_latest(tmp_path):
    manager = eqxs.CheckpointManager(tmp_path, every_steps=3)
    assert manager.latest_step() is None
    with pytest.raises(FileNotFoundError, match="No checkpoint in"):
        manager.restore(_state(0))
    saved = {}
    for step in range(8):
        state = _state(step)
        if manager.save(step, state):
            saved[step] = snapshot(eqx.filter(state, eqx.is_array))
    manager.wait_until_finished()
    assert list(saved) == [0, 3, 6] == manager.all_steps()
    # (and, while the manager is open, its lock naming the writing process)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".eqxs-writer", "0", "3", "6"]
    assert manager.latest_step() == 6
    out = manager.restore(_state(0))
    assert_same_values(eqx.filter(out, eqx.is_array), saved[6])
    assert out["step"] == 6
    # A step directory is what `eqxs.save` writes.
    out = eqxs.restore(tmp_path / "3", _state(0))
    assert_same_values(eqx.filter(out, eqx.is_array), saved[3])
    assert manager.save(7, _state(7), force=True)  # not a multiple of 3
    assert not manager.should_save(7) and not manager.should_save(5)
    assert manager.should_save(9)
    with pytest.raises(FileNotFoundError, match=r"of step 4 .*its steps: 0, 3, 6, 7"):
        manager.restore(_state(0), step=4)
    # `like` is checked against the record of leaves, naming the leaf.
    wrong = dict(_state(0), step=jnp.zeros(3))
    with pytest.raises(ValueError, match=r"like\['step'\]: the checkpoint at"):
        manager.restore(wrong)
    manager.close()


def test_retention(tmp_path):
    # Keep the last 2 and every 4th.
    with eqxs.CheckpointManager(tmp_path, keep_last=2, keep_every=4) as manager:
        for step in range(11):
            assert manager.save(step, {"x": jnp.full(4, float(step)), "n": step})
        manager.wait_until_finished()
        assert manager.all_steps() == [0, 4, 8, 9, 10]
        steps = sorted(
            int(p.name) for p in tmp_path.iterdir() if p.name != ".eqxs-writer"
        )
        assert steps == [0, 4, 8, 9, 10]
        out = manager.restore({"x": jnp.zeros(4), "n": 0}, step=4)
        np.testing.assert_array_equal(np.asarray(out["x"]), 4.0)


def test_every_minutes(tmp_path):
    # Saves when none exists, then not again within the hour (unless a step policy
    # says so).
    with eqxs.CheckpointManager(tmp_path, every_minutes=60, every_steps=5) as m:
        assert m.should_save(1) and m.save(1, {"x": jnp.ones(2)})
        m.wait_until_finished()
        assert [m.should_save(s) for s in (2, 3, 4, 5)] == [False, False, False, True]


def test_arguments(tmp_path):
    with pytest.raises(ValueError, match="`keep_last` must be a positive number"):
        eqxs.CheckpointManager(tmp_path, keep_last=0)
    with pytest.raises(ValueError, match="`every_minutes` must be a positive number"):
        eqxs.CheckpointManager(tmp_path, every_minutes=-1.0)
    # Each names its own argument.
    with pytest.raises(ValueError, match="^`every_steps` must be a positive number"):
        eqxs.CheckpointManager(tmp_path, every_steps=0)
    with pytest.raises(ValueError, match="^`keep_every` must be a positive number"):
        eqxs.CheckpointManager(tmp_path, keep_every=0)
    assert list(tmp_path.iterdir()) == []


def test_resume_on_another_layout(tmp_path):
    fsdp = auto_mesh(names=("data",))
    state = _put(_state(0), fsdp, FSDP)
    expected = snapshot(eqx.filter(state, eqx.is_array))
    with eqxs.CheckpointManager(tmp_path) as manager:
        manager.save(10, state)
    two_d = auto_mesh((4, 2), ("data", "model"))
    like = eqx.filter_eval_shape(_state, 0)
    with eqxs.CheckpointManager(tmp_path) as manager:
        assert manager.latest_step() == 10
        with jax.set_mesh(two_d):
            out = manager.restore(like, shardings=TWO_D)
    assert_same_values(eqx.filter(out, eqx.is_array), expected)
    for path, x in jtu.tree_flatten_with_path(out["model"])[0]:
        if eqx.is_array(x):
            split = jtu.keystr(path).endswith("weight")
            spec = P("data", "model") if split else P()
            assert x.sharding.is_equivalent_to(NamedSharding(two_d, spec), x.ndim)
    assert out["model"].activation is like["model"].activation


# Random, so that `_flip_byte_of` finds its bytes in the data files.
_RANDOM = np.random.default_rng(0).integers(0, 2**32, 4096, dtype=np.uint32)

# Per option of `eqxs.restore` but `path` and `like`: `make(step_directory)`, a value
# of it that changes what `restore` returns from the checkpoint there (after damaging
# it, for an option about damage). A new option of `restore` needs its entry here.
_RESTORE_OPTIONS = {
    "shardings": lambda directory: NamedSharding(auto_mesh(), P("x")),
}


def _outcome(restore) -> list | tuple:
    """What `restore()` gives, comparable: each leaf's bytes and committed sharding,
    or the `ValueError` it raises."""
    try:
        out = restore()
    except ValueError as e:
        return ("ValueError", str(e))
    return [
        (np.array(x).tobytes(), x.sharding if getattr(x, "committed", False) else None)
        for x in jtu.tree_leaves(out)
    ]


def test_manager_restore_passes_on_every_option_of_restore(tmp_path):
    """`CheckpointManager.restore` has every option of `eqxs.restore`, with its
    default, and passes it on: given a value that changes what `eqxs.restore` returns,
    it returns the same."""
    options = dict(inspect.signature(eqxs.restore).parameters)
    del options["path"], options["like"]
    ours = dict(inspect.signature(eqxs.CheckpointManager.restore).parameters)
    del ours["self"], ours["like"], ours["step"]
    assert {k: p.default for k, p in ours.items()} == {
        k: p.default for k, p in options.items()
    }
    assert sorted(_RESTORE_OPTIONS) == sorted(options)
    state = {"w": jnp.asarray(_RANDOM), "n": 3}
    with eqxs.CheckpointManager(tmp_path, background=False) as manager:
        for step, (name, make) in enumerate(_RESTORE_OPTIONS.items()):
            manager.save(step, state)
            option = {name: make(tmp_path / str(step))}
            default = _outcome(lambda: manager.restore(state, step=step))
            expected = _outcome(
                lambda: eqxs.restore(tmp_path / str(step), state, **option)
            )
            assert expected != default, name  # the value tells the option apart
            out = _outcome(lambda: manager.restore(state, step=step, **option))
            assert out == expected, name


def test_manager_restore_verifies_the_checksums(tmp_path):
    with eqxs.CheckpointManager(tmp_path) as manager:
        manager.save(0, {"w": jnp.asarray(_RANDOM), "n": 3})
        manager.wait_until_finished()
        _flip_byte_of(tmp_path / "0" / "arrays", _RANDOM)
        with pytest.raises(ValueError, match=r"like\['w'\]: .* checksum"):
            manager.restore({"w": jnp.zeros(4096, jnp.uint32), "n": 0})


def test_background_save_racing_a_donating_step(tmp_path):
    # Each save runs in the background while the next steps donate (and overwrite)
    # the very state being saved.
    mesh = auto_mesh(names=("data",))
    state = _put({"w": jnp.arange(1 << 16, dtype=jnp.float32).reshape(256, 256),
                  "b": jnp.ones(256), "key": jax.random.key(0)},
                 mesh, eqxs.PathRules([(r"w", P("data"))], default=P()))  # fmt: skip

    @eqxs.filter_jit(donate="all")
    def step(s):
        key, sub = jax.random.split(s["key"])
        noise = jax.random.normal(sub, s["w"].shape)
        return {"w": s["w"] * 2 + noise, "b": s["b"] + 1, "key": key}

    saved = {}
    with eqxs.CheckpointManager(tmp_path, every_steps=2) as manager:
        for i in range(8):
            if manager.should_save(i):
                saved[i] = snapshot(state)
                assert manager.save(i, state)
            state = step(state)
        manager.wait_until_finished()
        like = eqx.filter_eval_shape(lambda: state)
        for i, values in saved.items():
            assert_same_values(manager.restore(like, step=i), values)
    assert list(saved) == [0, 2, 4, 6]


def test_a_log_line_per_save_and_restore(tmp_path, caplog):
    state = {"x": jnp.ones((4, 4)), "n": 1}
    with caplog.at_level(logging.INFO, logger="equinox_shard"):
        with eqxs.CheckpointManager(tmp_path) as manager:
            manager.save(5, state)
            manager.wait_until_finished()
            manager.restore(state)
    messages = [r.getMessage() for r in caplog.records if r.name == "equinox_shard"]
    assert any(m.startswith(f"saved step 5 to {tmp_path / '5'}: 64 bytes in ")
               for m in messages), messages  # fmt: skip
    assert any(m.startswith(f"restored step 5 from {tmp_path / '5'}: 64 bytes in ")
               for m in messages), messages  # fmt: skip


def test_a_lock_file_removed_under_the_manager_is_logged(tmp_path, caplog):
    # Someone else removed the writer's lock: closing says so, naming it, and releases.
    manager = eqxs.CheckpointManager(tmp_path)
    lock = tmp_path / ".eqxs-writer"
    lock.unlink()
    with caplog.at_level(logging.WARNING, logger="equinox_shard"):
        manager.close()
    assert [r.getMessage() for r in caplog.records if r.name == "equinox_shard"] == [
        f"could not remove the writer's lock {lock} of {tmp_path} (FileNotFoundError: "
        f"[Errno 2] No such file or directory: '{lock}'); it is released."
    ]
    with eqxs.CheckpointManager(tmp_path, background=False) as manager:
        assert manager.all_steps() == []


def test_blocking_saves(tmp_path, caplog):
    states = {s: {"x": jnp.full((2, 3), float(s)), "n": s} for s in (2, 4)}
    with caplog.at_level(logging.INFO, logger="equinox_shard"):
        with eqxs.CheckpointManager(
            tmp_path, background=False, every_steps=2, keep_last=1
        ) as manager:
            for step in range(5):
                if manager.save(step, states.get(step, states[2])):
                    # Complete once `save` returns, and logged then.
                    assert (tmp_path / str(step) / "_CHECKPOINT_METADATA").is_file()
                    mine = [r for r in caplog.records if r.name == "equinox_shard"]
                    message = mine[-1].getMessage()
                    assert message.startswith(f"saved step {step} to "), message
            assert manager.latest_step() == 4
            assert manager.all_steps() == [4]
            out = manager.restore(states[2])
    assert out["n"] == 4
    assert_same_values(out, snapshot(states[4]))
    with eqxs.CheckpointManager(tmp_path, background=False) as manager:
        assert_same_values(manager.restore(states[2], step=4), snapshot(states[4]))


@pytest.mark.slow
def test_a_manager_cannot_cross_processes(tmp_path):
    # multiprocessing's spawn pickles a child's arguments; the manager's lock and
    # orbax's threads cannot go, and the child could not write there meanwhile.
    import multiprocessing
    import pickle

    message = "A CheckpointManager cannot be passed to another process"
    with eqxs.CheckpointManager(tmp_path / "steps") as manager:
        with pytest.raises(TypeError, match=message) as e:
            pickle.dumps(manager)
        assert "open a CheckpointManager on" in str(e.value)
        assert "refused while this one is open" in str(e.value)
        child = multiprocessing.get_context("spawn").Process(
            target=print, args=(manager,)
        )
        with pytest.raises(TypeError, match=message):
            child.start()
        assert manager.save(0, {"x": jnp.ones(2)})
    assert sorted(p.name for p in (tmp_path / "steps").iterdir()) == ["0"]


def test_interrupted_save_is_never_latest(tmp_path):
    # Step 2 written, not finalised.
    line, _ = killed_after_first_line(worker.__file__, "manager-killed", str(tmp_path))
    assert line == "WRITTEN\n"
    assert any(".orbax-checkpoint-tmp" in p.name for p in tmp_path.iterdir())
    with eqxs.CheckpointManager(tmp_path) as manager:
        assert manager.latest_step() == 1
        out = manager.restore(worker.overwrite_state("new"))
        assert_same_values(out, worker.overwrite_state("old"))
        # Step 2 can be saved again, and the leftover is gone (orbax removes it in
        # the background once the manager is created; a save waits for that).
        manager.save(2, worker.overwrite_state("new"))
        manager.wait_until_finished()
        assert manager.all_steps() == [1, 2]
        steps = sorted(p.name for p in tmp_path.iterdir())
        assert steps == [".eqxs-writer", "1", "2"]  # and the open manager's lock


@pytest.mark.slow
def test_docs_training_loop_runs(tmp_path):
    # docs/checkpoints.md's loop, as written (in a fresh process: it sets up meshes
    # and a manager of its own).
    docs = pathlib.Path(__file__).parent.parent / "docs"
    text = (docs / "checkpoints.md").read_text()
    code = text.split("<!-- training-loop -->\n```python\n", 1)[1].split("```", 1)[0]
    code = code.replace('"/tmp/eqxs_training_loop"', repr(str(tmp_path)))
    # As a user runs it: 8 CPU devices, JAX's default dtype promotion (optax's Adam
    # needs it).
    setup = 'import jax\njax.config.update("jax_num_cpu_devices", 8)\n'
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    runs = []
    for _ in range(2):  # run again on the same directory: nothing to do
        result = subprocess.run(
            [sys.executable, "-c", setup + code],
            capture_output=True, text=True, timeout=HANG_SECONDS, env=env,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-4000:]
        runs.append(result.stdout.splitlines())
        assert sorted(p.name for p in tmp_path.iterdir()) == ["30", "40"]
    first, second = runs
    assert len(first) == 2, first
    assert first[0].startswith("steps 0..25: loss ") and first[0].endswith("[20, 25]")
    assert first[1].startswith("steps 25..40: loss ") and first[1].endswith("[30, 40]")
    assert second == ["steps 40..40: nothing to do; kept [30, 40]"] * 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes(tmp_path):
    # 2 `jax.distributed` processes of 4 devices save in the background and restore
    # the latest onto another layout (each checks its own shards); then one process
    # of 8 devices restores the same checkpoint.
    coordinator = f"127.0.0.1:{_free_port()}"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    procs = [
        subprocess.Popen(
            [sys.executable, worker.__file__, "manager-multiprocess", str(tmp_path),
             str(p), "2", coordinator],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
            start_new_session=True,
        )
        for p in range(2)
    ]  # fmt: skip
    try:
        outputs = [proc.communicate(timeout=HANG_SECONDS)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    for proc, output in zip(procs, outputs):
        assert proc.returncode == 0, output[-4000:]
        assert "manager-multiprocess: ok" in output
    written = sorted(p.name for p in (tmp_path / "3" / "arrays").iterdir())
    assert "ocdbt.process_0" in written and "ocdbt.process_1" in written, written
    reference = worker.reference_state()
    with eqxs.CheckpointManager(tmp_path) as manager:
        assert manager.all_steps() == [0, 3]
        out = manager.restore(eqx.filter_eval_shape(worker.reference_state))
    assert_same_values(
        eqx.filter(out, eqx.is_array), eqx.filter(reference, eqx.is_array)
    )


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["first", "half", "last"])
def test_killed_while_deleting_old_steps(tmp_path, phase):
    # keep_last=2: saving step 3 deletes step 1; killed once the first, half, or all
    # but the last of step 1's files and directories are removed.
    args = ("manager-retention-killed", str(tmp_path), phase)
    line, _ = killed_after_first_line(worker.__file__, *args)
    assert line == "DELETING\n"
    with eqxs.CheckpointManager(tmp_path, keep_last=2) as manager:
        assert manager.latest_step() == 3
        out = manager.restore(worker.retention_state(0))
        assert_same_values(out, worker.retention_state(3))
        # The partly deleted step restores exactly, or says it is partly deleted.
        if 1 in manager.all_steps():
            try:
                out = manager.restore(worker.retention_state(0), step=1)
            except FileNotFoundError as e:
                assert re.match(
                    r"The checkpoint of step 1 in .* is partly deleted", str(e)
                )
            else:
                assert_same_values(out, worker.retention_state(1))
        # The next save removes it.
        manager.save(4, worker.retention_state(4))
        manager.wait_until_finished()
        assert manager.all_steps() == [3, 4]
        steps = sorted(p.name for p in tmp_path.iterdir())
        assert steps == [".eqxs-writer", "3", "4"]  # and the open manager's lock
