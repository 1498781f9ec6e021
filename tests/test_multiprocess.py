"""The three functions under JAX's multi-controller runtime (`jax.distributed`), for
real: `NUM_PROCESSES` JAX processes on this machine, talking over loopback (a
coordinator on 127.0.0.1, CPU collectives via gloo), each with 4 simulated CPU devices,
so that the global mesh has 8 devices of which each process can address only its own 4.

The processes run tests/multiprocess_worker.py once for the whole module (starting JAX
takes seconds), started and stopped here with a deadline: a process that hangs (a peer
waiting forever in a collective) is killed with its process group, and the tests fail
instead of hanging.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import equinox_shard as eqxs
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from . import multiprocess_worker as worker
from .helpers import assert_shardings, auto_mesh
from .isolated import HANG_SECONDS


NUM_PROCESSES = 2
# For the whole run, both processes: about 25 s on 2 shared cores; the deadline only
# guards against peers left waiting for a dead process.
DEADLINE_SECONDS = HANG_SECONDS


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill(procs) -> None:
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:  # pragma: no cover - exited meanwhile
                pass
        proc.wait()


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    """Runs the worker in `NUM_PROCESSES` processes; returns each one's results."""
    out = tmp_path_factory.mktemp("multiprocess")
    coordinator = f"127.0.0.1:{_free_port()}"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    procs, logs = [], []
    try:
        for p in range(NUM_PROCESSES):
            logs.append(out / f"process{p}.log")
            with open(logs[-1], "w") as log:
                procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            worker.__file__,
                            str(p),
                            str(NUM_PROCESSES),
                            coordinator,
                            str(out / f"process{p}.json"),
                        ],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=env,
                        start_new_session=True,  # its own process group, to kill
                    )
                )
        deadline = time.monotonic() + DEADLINE_SECONDS
        failed = None
        while failed is None and any(proc.poll() is None for proc in procs):
            if time.monotonic() > deadline:
                failed = f"timed out after {DEADLINE_SECONDS} s"
            elif any(proc.poll() not in (None, 0) for proc in procs):
                # A dead process leaves its peers waiting in a collective.
                failed = "a process failed"
            else:
                time.sleep(0.1)
    finally:
        _kill(procs)
    codes = [proc.returncode for proc in procs]
    if failed is not None or any(codes):
        text = "\n".join(
            f"--- process {p} (exit code {code}) ---\n{log.read_text()[-4000:]}"
            for p, (code, log) in enumerate(zip(codes, logs))
        )
        pytest.fail(f"multi-process run: {failed or 'non-zero exit'}\n{text}")
    return [
        json.loads((out / f"process{p}.json").read_text()) for p in range(NUM_PROCESSES)
    ]


def _data(results, name) -> list:
    for p, r in enumerate(results):
        assert r[name]["ok"], f"process {p}:\n{r[name]['error']}"
    return [r[name]["data"] for r in results]


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        "check_replicated_parameters",
        "check_sharded_identical_values",
        "check_process_local_batch",
        "check_place_host_local_helper",
    ],
)
def test_placement(results, name):
    # The assertions (every shard of every array, non-array leaves by identity) run in
    # the worker; here, that they passed on every process.
    _data(results, name)


@pytest.mark.slow
def test_training_matches_single_process(results):
    data = _data(results, "train")
    reference = worker.train()  # One process, 8 devices (tests/conftest.py).
    assert reference["local_rows"] == [0, worker.BATCH]
    assert [d["local_rows"] for d in data] == [
        [p * worker.BATCH // NUM_PROCESSES, (p + 1) * worker.BATCH // NUM_PROCESSES]
        for p in range(NUM_PROCESSES)
    ]
    for d in data:
        assert d["traces"] == 1
        assert d["fully_addressable"] == [False] * len(d["params"])
        # Every process holds the same replicated values.
        assert d["losses"] == data[0]["losses"]
        for a, b in zip(d["params"], data[0]["params"]):
            np.testing.assert_array_equal(a, b)
    assert reference["traces"] == 1
    assert reference["fully_addressable"] == [True] * len(reference["params"])
    # The same losses as the single-process run (up to the order of the all-reduce).
    np.testing.assert_allclose(data[0]["losses"], reference["losses"], rtol=1e-5)
    assert reference["losses"][-1] < reference["losses"][0]
    for a, b in zip(data[0]["params"], reference["params"]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def _differing_message(path: str) -> str:
    return (
        f"{path}: this array must have the same value on every process (its sharding "
        "NamedSharding(mesh=Mesh('x': 8, axis_types=(Auto,)), spec=P(), "
        "memory_kind=device) spans all 2 processes, and each process supplies the "
        "whole array), but processes [1] hold a different value from process 0."
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, path",
    [
        ("check_differing_local_data", "local_data['b']"),
        ("check_place_host_local_differing", "x['b']"),
    ],
)
def test_differing_values_name_the_key_path(results, name, path):
    # Raised on every process alike, so that none is left waiting in a collective.
    for error in _data(results, name):
        assert error["type"] == "ValueError"
        assert error["message"].startswith(_differing_message(path)), error["message"]


@pytest.mark.slow
def test_sharding_without_devices_in_this_process(results):
    first, second = _data(results, "check_no_device_in_process")
    # filter_device_put: as jax.device_put, nothing to hold in process 1.
    assert first["shards"] == 4 and second["shards"] == 0
    assert first["error"] == {"type": None, "message": None}
    assert second["error"]["type"] == "ValueError"
    assert second["error"]["message"].startswith(
        "local_data['a']: the sharding NamedSharding(mesh=Mesh('x': 4, "
        "axis_types=(Auto,)), spec=P('x',), memory_kind=device) has no device in this "
        "process (process 1; its devices belong to processes [0])"
    ), second["error"]["message"]


@pytest.mark.slow
def test_filter_device_put_committed_arrays_and_keys(results):
    _data(results, "check_filter_device_put_committed_and_keys")


@pytest.mark.slow
def test_filter_device_put_differing_values_name_the_key_path(results):
    for error in _data(results, "check_filter_device_put_differing"):
        assert error["type"] == "ValueError"
        assert error["message"].startswith(_differing_message("x['b']"))


@pytest.mark.slow
def test_filter_jit_numpy_argument(results):
    identical, differing = zip(*_data(results, "check_filter_jit_numpy_argument"))
    assert all(e == {"type": None, "message": None} for e in identical), identical
    for error in differing:
        assert error["type"] == "ValueError"
        assert error["message"].startswith("y: this array must have the same value")


@pytest.mark.slow
def test_example_runs_across_processes():
    # examples/multiprocess.py, as the README runs it, for one epoch: it launches its
    # own processes (with its own deadline) and checks the losses against a
    # single-device run; our deadline is a backstop.
    example = os.path.join(os.path.dirname(worker.__file__), "..", "examples")
    with subprocess.Popen(
        [
            sys.executable,
            os.path.join(example, "multiprocess.py"),
            "--epochs=1",
            "--min-accuracy=0",
            f"--timeout={DEADLINE_SECONDS - 30}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        start_new_session=True,
        text=True,
    ) as proc:
        try:
            output, _ = proc.communicate(timeout=DEADLINE_SECONDS)
        except subprocess.TimeoutExpired:
            _kill([proc])
            output, _ = proc.communicate()
            pytest.fail(f"timed out after {DEADLINE_SECONDS} s:\n{output[-4000:]}")
    assert proc.returncode == 0, output[-4000:]
    assert "2 processes x 4 CPU devices = 8 devices" in output
    assert "ok   per-step losses match the single-device run" in output
    assert "ok   compiled once: {'train_step': 1, 'num_correct': 1}" in output


#
# In one process (fast): `filter_make_array_from_process_local_data` is then
# `filter_device_put`.
#


def test_process_local_data_single_process():
    mesh = auto_mesh()
    sharded = NamedSharding(mesh, P("x"))
    fn = lambda: None
    keys = jr.split(jr.key(0), 8)
    local = {"x": np.ones((8, 3), np.float32), "k": keys, "fn": fn, "n": 3, "y": keys}
    out = eqxs.filter_make_array_from_process_local_data(
        {"x": sharded, "k": sharded, "fn": sharded, "n": sharded, "y": None},
        local,
        global_shape={"x": (8, 3), "k": None, "fn": None, "n": None, "y": None},
    )
    assert_shardings(
        out, {"x": sharded, "k": sharded, "fn": None, "n": None, "y": None}
    )
    np.testing.assert_array_equal(np.asarray(out["x"]), local["x"])
    assert jnp.array_equal(jr.key_data(out["k"]), jr.key_data(keys))
    assert out["fn"] is fn and out["n"] == 3 and out["y"] is keys
    # Already placed: the same objects.
    again = eqxs.filter_make_array_from_process_local_data(sharded, out["x"])
    assert again is out["x"]


@pytest.mark.devices(8, reason="a dimension size that 8 devices do not divide")
def test_process_local_data_single_process_indivisible():
    sharded = NamedSharding(auto_mesh(), P("x"))
    local = {"a": np.ones((8, 3), np.float32), "b": np.ones(4, np.float32)}
    with pytest.raises(ValueError, match=r"^local_data\['b'\]: dimension 0"):
        eqxs.filter_make_array_from_process_local_data(sharded, local)


def test_process_local_data_single_process_errors():
    sharded = NamedSharding(auto_mesh(), P("x"))
    local = {"a": np.ones((8, 3), np.float32), "b": np.ones(4, np.float32)}
    with pytest.raises(ValueError) as e:
        eqxs.filter_make_array_from_process_local_data(
            sharded, local, global_shape={"a": None, "b": (8,)}
        )
    assert str(e.value) == (
        "local_data['b']: in a single-process run, `global_shape` must be None or "
        "the local shape (4,); got (8,)."
    )
    with pytest.raises(ValueError, match="`global_shape` must be None, a shape"):
        eqxs.filter_make_array_from_process_local_data(
            sharded, local, global_shape=[(8, 3), (4,)]
        )
    with pytest.raises(TypeError, match="got a leaf 'big'"):
        eqxs.filter_make_array_from_process_local_data(
            sharded, local, global_shape={"a": "big", "b": None}
        )
    with pytest.raises(ValueError, match=r"`shardings` must be a PyTree prefix"):
        eqxs.filter_make_array_from_process_local_data({"a": sharded}, local)
