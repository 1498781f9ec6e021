"""The progress bar of a restore: on stderr where it is a terminal, once the restore
has run `equinox_shard._checkpoint.progress.DELAY_SECONDS` (set here, not timed);
nothing otherwise."""

import contextlib
import io
import re
import sys

import equinox_shard as eqxs
import equinox_shard._checkpoint.progress as progress
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from .helpers import auto_mesh


pytest.importorskip("orbax.checkpoint")
pytest.importorskip("rich")


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def _state():
    mesh = auto_mesh(names=("data",))
    w = jax.device_put(
        jnp.arange(2**16.0).reshape(256, 256), NamedSharding(mesh, P("data"))
    )
    return {"w": w, "b": np.arange(8.0), "n": 1}


def _restore(monkeypatch, stream, delay, restore):
    monkeypatch.setattr(progress, "DELAY_SECONDS", delay)
    monkeypatch.setattr(sys, "stderr", stream)
    out = restore()
    monkeypatch.setattr(sys, "stderr", sys.__stderr__)
    np.testing.assert_array_equal(
        np.asarray(out["w"]), np.arange(2**16.0).reshape(256, 256)
    )
    return stream.getvalue()


@pytest.mark.parametrize("counted", [True, False])
@pytest.mark.parametrize("manager", [False, True])
def test_progress_bar_only_on_a_terminal(tmp_path, monkeypatch, manager, counted):
    if not counted:
        # A host that lets no process read `/proc/self/io` (the TPU v5e host's): no
        # byte count, and a bar that shows the restore runs.
        monkeypatch.setattr(progress, "_bytes_read", lambda: 0)
    elif not progress._bytes_read():
        pytest.skip("this host lets no process read /proc/self/io")
    state = _state()
    with contextlib.ExitStack() as stack:
        if manager:
            m = stack.enter_context(eqxs.CheckpointManager(tmp_path))
            m.save(7, state)
            restore = lambda: m.restore(state)
            where = "restoring step 7"
        else:
            eqxs.save(tmp_path / "ckpt", state)
            restore = lambda: eqxs.restore(tmp_path / "ckpt", state)
            where = "restoring ckpt"
        # A terminal, and the restore has run long enough: a bar, complete at the end.
        shown = _restore(monkeypatch, _Terminal(), 0, restore)
        assert where in shown, shown
        assert "━" in shown, shown
        if counted:
            assert re.search(r"(\d+\.\d+)/\1 [kMG]?B", shown), shown  # e.g. 0.3/0.3 MB
        else:
            assert not re.search(r"\d [kMG]?B", shown), shown
        # No terminal: nothing, however long the restore.
        assert _restore(monkeypatch, io.StringIO(), 0, restore) == ""
        # A terminal, a restore quicker than the delay: nothing.
        assert _restore(monkeypatch, _Terminal(), 3600, restore) == ""
