import json
import os
import pathlib
import subprocess
import sys

import pytest


_ROOT = pathlib.Path(__file__).parent.parent


@pytest.mark.benchmark
@pytest.mark.slow
def test_quick_run(tmp_path):
    # A smoke run of `python -m benchmarks --quick` in a fresh process (it sets up its
    # own 8 simulated devices): it must run to the end and produce every table and
    # every JSON key. Times are never asserted; the counts and identities are.
    out = tmp_path / "quick.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--quiet", "--json", str(out)],
        cwd=_ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    for title in (
        "### Dispatch: calling-thread CPU",
        "### Dispatch: wall",
        "### Callbacks: wall",
        "### Eager placement",
        "### Scaling",
        "### Compilations",
        "### Training step",
        "### Training step fed a fresh batch every step",
        "### Dispatch of inputs as users pass them",
        "### Equinox#973",
        "### filter_shard_map vs jax.shard_map",
        "### Targets",
    ):
        assert title in proc.stdout, title

    results = json.loads(out.read_text())
    assert set(results) == {
        "meta",
        "dispatch",
        "callbacks",
        "placement",
        "compiles",
        "step",
        "shard_map",
        "scaling",
        "targets",
    }
    assert results["meta"]["quick"] is True
    assert results["meta"]["devices"] == 8
    for key in ("date", "nproc", "cpu", "jax", "equinox", "command"):
        assert key in results["meta"], key

    rows = results["shard_map"]["rows"]
    assert len(rows) == len(results["meta"]["config"]["ns"]) * 2 * 2
    assert all(row["equal"] for row in rows)  # the same numbers as jax.shard_map

    dispatch = results["dispatch"]
    assert dispatch["variants"] == [
        "floor",
        "jit+shard",
        "flat",
        "flat+lock",
        "eqx",
        "eqxs",
        "eqxs+shard",
    ]
    ns = results["meta"]["config"]["ns"]
    layouts = results["meta"]["config"]["layouts"]
    assert len(dispatch["rows"]) == len(ns) * len(layouts) * 2 * 2
    for row in dispatch["rows"]:
        assert set(row["seconds"]) == set(dispatch["variants"])
        assert all(s > 0 for s in row["seconds"].values())
        assert row["ratio_to_floor"]["floor"] == 1.0
        assert set(row["ratio_to_flat"]) == {"eqxs", "eqxs+shard"}
        assert all(x > 0 for x in row["ratio_to_flat"].values())
    # The flat sketch is a column of both tables, each async cell marked against the
    # targets of issue 23.
    assert proc.stdout.count("| flat sketch |") == 2
    assert "eqxs/flat sketch (<= 1.1x)" in proc.stdout
    # Beside it, the flat sketch with the lock that ours takes (multi-device, CPU), and
    # the noise of one cell: that sketch on one device, where it takes no lock.
    assert proc.stdout.count("| flat sketch+lock |") == 2
    assert "eqxs/flat sketch+lock" in proc.stdout
    assert "Noise: on single-device cells" in proc.stdout
    for row in dispatch["rows"]:
        assert row["eqxs_over_flat_lock"] > 0 and row["flat_lock_over_flat"] > 0
    async_table = proc.stdout.split("### Dispatch: wall")[0]
    assert async_table.count(" pass |") + async_table.count(" FAIL |") == 2 * len(
        [r for r in dispatch["rows"] if r["mode"] == "async"]
    )

    placement = results["placement"]
    assert len(placement["rows"]) == len(ns) * len(layouts) * 2
    assert "eqxs.fdp (target)" in proc.stdout
    for row in placement["rows"]:
        assert set(row["seconds"]) == set(placement["variants"])
        assert row["fdp_over_copy"] > 0
        assert row["ratio_to_owned"]["eqxs.fdp"] > 0
        # Non-array leaves always come back as the same objects.
        assert set(row["same_object_non_array"].values()) == {1.0}
        if row["source"] == "placed":
            # Already-placed arrays come back as the same objects...
            assert row["same_object"]["eqxs.fdp"] == 1.0
            assert row["same_object"]["eqxs.fs"] == 1.0
        else:
            # ...whilst uncommitted ones are transferred.
            assert row["same_object"]["eqxs.fdp"] == 0.0
    assert proc.stdout.count("copy (<= 1.05x) pass") + proc.stdout.count(
        "copy (<= 1.05x) FAIL"
    ) == 2 * len([r for r in placement["rows"] if r["source"] == "uncommitted"])

    # `filter_jit` with shardings compiles once in every scenario.
    counts = results["compiles"]["counts"]
    assert set(counts) == {"fresh values", "fresh equal Modules", "x = f(x)"}
    for scenario in counts.values():
        assert scenario["eqxs+shard"] == 1
        assert set(scenario) == {"eqxs+shard", "jit+shard", "eqx", "eqxs"}

    # Issue 48's cells: every source, tree and N, on one device and on eight.
    inputs = results["dispatch"]["inputs"]["rows"]
    assert {(r["devices"], r["source"], r["tree"], r["n"]) for r in inputs} == {
        (d, s, k, n)
        for d in (1, 8)
        for s in ("uncommitted", "numpy", "committed")
        for k in ("module", "list")
        for n in ns
    }
    assert all(
        set(r["seconds"]) == {"eqxs+shard", "flat+shard", "jit+shard"} for r in inputs
    )
    # Equinox#973's scenario is a section too, with its two targets.
    identity = results["dispatch"]["identity"]
    assert set(identity["seconds"]) == {"jit", "eqxs", "jit+shard", "eqxs+shard", "eqx"}
    names = {target["target"] for target in results["targets"]}
    assert {n for n in names if n.startswith("Equinox#973")} == {
        "Equinox#973 (eqx.nn.Identity, synchronous) eqxs/jax.jit",
        "Equinox#973 (eqx.nn.Identity, synchronous) eqxs+shard/jax.jit+shard",
    }
    step = results["step"]
    feeds = step["feeds"]["rows"]
    assert {(r["devices"], r["feed"]) for r in feeds} == {
        (d, f) for d in (8, 1) for f in ("numpy", "jnp.asarray")
    }
    assert set(step["steps_per_second"]) == {"eqxs", "jit", "eqx tutorial"}
    assert set(step["peak_rss_mib"]) == {"eqxs", "jit", "eqx tutorial"}
    assert step["n_params"] > 0

    assert {s["what"] for s in results["scaling"]} == {"dispatch", "placement"}
    assert len(results["targets"]) > 0
    for target in results["targets"]:
        assert set(target) == {
            "target",
            "value",
            "median_over_cells",
            "threshold",
            "at_most",
            "met",
            "detail",
        }


@pytest.mark.benchmark
@pytest.mark.slow
def test_checkpoint_quick_run(tmp_path):
    # `python -m benchmarks --only checkpoint --quick`: every variant saves and
    # restores the transformer state bit for bit into the same shardings; eqxs and
    # orbax never hold more on one device than its share, whilst the usual
    # deserialise-then-place holds the whole state on one device. Times not asserted.
    pytest.importorskip("orbax.checkpoint")
    out = tmp_path / "checkpoint.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--only", "checkpoint", "--quick"]
        + ["--quiet", "--json", str(out)],
        cwd=_ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "### Checkpoints:" in proc.stdout
    results = json.loads(out.read_text())
    checkpoint = results["checkpoint"]
    variants = ["eqxs", "orbax", "eqx", "manager"]
    assert checkpoint["variants"] == variants
    assert checkpoint["restored_equal"] == dict.fromkeys(variants, True)
    share = checkpoint["per_device_share_bytes"]
    peaks = checkpoint["restore_peak_device_bytes"]
    # Plus, briefly, each array's 4-byte checksum, computed where the array lies.
    checksums = 4 * checkpoint["n_arrays"]
    assert peaks["orbax"] <= share
    assert peaks["eqxs"] <= share + checksums and peaks["manager"] <= share + checksums
    assert peaks["eqx"] >= checkpoint["state_bytes"]
    assert all(s > 0 for s in checkpoint["save_seconds"].values())
    assert all(s > 0 for s in checkpoint["restore_seconds"].values())
    # 10 training steps with each kind of save, orbax's own background save the peer.
    modes = {"none", "background", "orbax-background", "blocking"}
    assert set(checkpoint["steps_seconds"]) == modes
    assert all(s > 0 for s in checkpoint["steps_seconds"].values())
    targets = [t["target"] for t in results["targets"]]
    assert targets == [
        "checkpoint save eqxs/orbax",
        "checkpoint restore eqxs/orbax",
        "checkpoint first restore in a fresh process eqxs/orbax",
    ]
    # The first restore in a fresh process (child processes), eqxs and orbax.
    assert all(s > 0 for s in checkpoint["cold_restore_seconds"].values())
    assert checkpoint["cold_restore_ratio_to_orbax"]["eqxs"] > 0


@pytest.mark.benchmark
@pytest.mark.slow
def test_device_quick_run(tmp_path):
    # `python -m benchmarks --device --quick` on the CPU: the accelerator run's table,
    # every row present, each measured or saying what the backend lacks (a CPU has no
    # `memory_stats`). Times are never asserted.
    pytest.importorskip("orbax.checkpoint")
    out = tmp_path / "device.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--device", "--quick", "--quiet"]
        + ["--json", str(out)],
        cwd=_ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "### On an accelerator" in proc.stdout
    from benchmarks.device import ROWS

    lines = proc.stdout.splitlines()
    for row in ROWS:
        assert any(line.startswith("|") and f" {row} |" in line for line in lines), row
    rows = {r["row"]: r for r in json.loads(out.read_text())["device"]["rows"]}
    assert list(rows) == list(ROWS)
    assert rows["training step peak memory"] == {
        "row": "training step peak memory",
        "na": "n/a (backend has no memory_stats)",
    }
    assert "n/a (backend has no memory_stats) |" in proc.stdout
    measured = [r for r in rows.values() if "na" not in r]
    assert len(measured) == len(ROWS) - 1
    for r in measured:
        assert r["eqxs"] > 0 and r["peer_value"] > 0 and r["ratio"] > 0, r


@pytest.mark.benchmark
@pytest.mark.slow
def test_pipeline_quick_run(tmp_path):
    # `python -m benchmarks --only pipeline --quick`: the example's three layouts train
    # to the same losses, the pipeline holds a quarter of the blocks per device, the
    # bubble is the formula, and remat lowers the step's temporary memory.
    pytest.importorskip("optax")
    out = tmp_path / "pipeline.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--only", "pipeline", "--quick"]
        + ["--quiet", "--json", str(out)],
        cwd=_ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    for title in ("### Pipeline: the transformer", "### Pipeline bubble"):
        assert title in proc.stdout, title
    pipeline = json.loads(out.read_text())["pipeline"]
    layouts = pipeline["layouts"]
    assert set(layouts) == {"data", "fsdp", "pipeline"}
    for result in layouts.values():
        assert result["traces"] == 1
        assert result["max_relative_loss_difference_to_data"] < 1e-5
    data, pipe = layouts["data"], layouts["pipeline"]
    assert data["param_bytes_per_device"] == data["param_bytes_total"]
    # A quarter of the blocks per device, beside the replicated (un)embedding.
    assert pipe["param_bytes_per_device"] < data["param_bytes_per_device"]
    for row in pipeline["bubble"]:
        assert row["idle"] == pytest.approx(row["formula"])
    remat = pipeline["remat_temp_bytes"]
    assert remat["True"] < remat["False"]


def test_paired_ratios_skip_rounds_whose_base_reads_zero():
    # A TPU host's thread CPU clock read 0 for whole samples: such rounds are left out
    # of the median, and a ratio with no round left is `None`, never a division by 0.
    from benchmarks._harness import paired_ratios

    samples = {"ours": [3.0, 2.0, 5.0, 1.0], "base": [0.0, 1.0, 2.0, 0.0]}
    assert paired_ratios(samples, ["ours"], "base") == {"ours": 2.25}
    assert paired_ratios({"ours": [1.0], "base": [0.0]}, ["ours"], "base") == {
        "ours": None
    }
    assert paired_ratios(samples, ["missing"], "base") == {"missing": None}


def test_inputs_cells_are_marked_against_issue_62s_targets():
    # Each cell of `run_inputs` by its own target: 1.1x on many CPU devices; on one,
    # 1.3x at N >= 10 and 1.5x at N = 1; 1.15x on an accelerator (it was 1.1x in
    # every cell, issue 48's).
    from benchmarks.dispatch import inputs_target, render_inputs

    def row(devices, n, platform="cpu", ratio=1.4):
        seconds = dict.fromkeys(("eqxs+shard", "flat+shard", "jit+shard"), 1e-5)
        return {
            "devices": devices,
            "platform": platform,
            "source": "numpy",
            "tree": "module",
            "n": n,
            "seconds": seconds,
            "eqxs_over_flat": ratio,
        }

    cells = [row(8, 10), row(1, 1), row(1, 10), row(1, 100), row(1, 1, "tpu")]
    assert [inputs_target(r) for r in cells] == [1.1, 1.5, 1.3, 1.3, 1.15]
    text = render_inputs({"rows": cells})
    assert "(1/5 cells pass)" in text  # 1.4x: only within N = 1's 1.5x on one CPU
