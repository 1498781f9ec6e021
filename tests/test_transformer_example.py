"""The second example, examples/train_transformer.py: each layout's rules place every
parameter and Adam moment where written below, directly at initialisation; a few steps
match an unsharded run; and the whole script checks itself (slow)."""

import dataclasses
import importlib.util
import os
import pathlib
import subprocess
import sys

import equinox as eqx
import jax
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P


_path = pathlib.Path(__file__).parent.parent / "examples" / "train_transformer.py"
_spec = importlib.util.spec_from_file_location("train_transformer", _path)
assert _spec is not None and _spec.loader is not None
train_transformer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_transformer)

CFG = train_transformer.Config(steps=4)


def _tensor(axis):
    return {
        ".embedding.weight": P(None, axis),
        ".blocks.attention.query_proj.weight": P(None, axis, None),
        ".blocks.attention.key_proj.weight": P(None, axis, None),
        ".blocks.attention.value_proj.weight": P(None, axis, None),
        ".blocks.attention.output_proj.weight": P(None, None, axis),
        ".blocks.mlp_in.weight": P(None, axis, None),
        ".blocks.mlp_in.bias": P(None, axis),
        ".blocks.mlp_out.weight": P(None, None, axis),
        ".unembed.weight": P(axis, None),
    }


# Written out by hand; every other parameter (norms, most biases) is replicated.
EXPECTED = {
    "data": {},
    "fsdp": {
        ".embedding.weight": P("data", None),
        ".position": P("data", None),
        ".blocks.attention.query_proj.weight": P(None, "data", None),
        ".blocks.attention.key_proj.weight": P(None, "data", None),
        ".blocks.attention.value_proj.weight": P(None, "data", None),
        ".blocks.attention.output_proj.weight": P(None, "data", None),
        ".blocks.mlp_in.weight": P(None, "data", None),
        ".blocks.mlp_out.weight": P(None, None, "data"),
        ".unembed.weight": P("data", None),
    },
    "tensor": _tensor("model"),
    "2d": _tensor("model"),
    # Every block's array (the layer axis first) over the stages.
    "pipeline": {
        f".blocks.{name}": P("stage")
        for name in (
            "norm1.weight",
            "norm1.bias",
            "attention.query_proj.weight",
            "attention.key_proj.weight",
            "attention.value_proj.weight",
            "attention.output_proj.weight",
            "norm2.weight",
            "norm2.bias",
            "mlp_in.weight",
            "mlp_in.bias",
            "mlp_out.weight",
            "mlp_out.bias",
        )
    },
}
MESH_SHAPES = {
    "data": {"data": 8},
    "fsdp": {"data": 8},
    "tensor": {"model": 8},
    "2d": {"data": 4, "model": 2},
    "pipeline": {"stage": 4, "data": 2},
}


def _check(tree, mesh, expected):
    n = 0
    for path, leaf in jtu.tree_flatten_with_path(tree)[0]:
        if not eqx.is_array(leaf):
            continue
        n += 1
        spec = expected.get(jtu.keystr(path), P())
        assert leaf.committed
        assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, spec), leaf.ndim), (
            jtu.keystr(path),
            leaf.sharding,
            spec,
        )
    assert n == 17  # every parameter of the model


# Slow: each compiles the model's initialisation twice (`test_init_directly_sharded`
# and `test_stacked_transformer_layers` take the same path on smaller models).
@pytest.mark.slow
@pytest.mark.devices(8)
@pytest.mark.parametrize("name", train_transformer.LAYOUTS)
def test_initialised_directly_into_the_rules(name):
    layout = train_transformer.make_layout(name, jax.devices())
    assert dict(layout.mesh.shape) == MESH_SHAPES[name]
    counts = {"train_step": 0}
    init, init_sharded, _ = train_transformer.make_functions(layout, CFG, counts)
    with jax.set_mesh(layout.mesh):
        model, opt_state = init_sharded(jr.key(0))
    _check(model, layout.mesh, EXPECTED[name])
    adam = opt_state[0]
    _check(adam.mu, layout.mesh, EXPECTED[name])
    _check(adam.nu, layout.mesh, EXPECTED[name])
    assert adam.count.sharding.is_equivalent_to(NamedSharding(layout.mesh, P()), 0)
    # Bit for bit the values of a JIT'd initialisation on one device (eager
    # `0.02 * normal` rounds differently from its fused, compiled form).
    reference = eqx.filter_jit(init)(jr.key(0))
    assert eqx.tree_equal(
        eqx.filter((model, opt_state), eqx.is_array),
        eqx.filter(reference, eqx.is_array),
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fsdp", "2d", "pipeline"])
@jax.numpy_dtype_promotion("standard")  # optax mixes its int32 step count with floats
def test_a_few_steps_match_one_device(name):
    corpus = train_transformer.load_corpus(200_000)
    assert len(corpus) == 200_000  # the standard library's own source, as bytes
    devices = jax.devices()
    cfg = dataclasses.replace(CFG, steps=4)
    single = train_transformer.train(
        train_transformer.make_layout("single", devices), cfg, corpus, resume=False
    )
    sharded = train_transformer.train(
        train_transformer.make_layout(name, devices), cfg, corpus, resume=False
    )
    assert sharded.trace_counts == {"train_step": 1}
    assert sharded.moments_follow
    np.testing.assert_allclose(
        sharded.losses, single.losses, rtol=train_transformer.LOSS_RTOL
    )
    assert sharded.losses[-1] < sharded.losses[0]


@pytest.mark.slow
def test_script_checks_itself():
    pytest.importorskip("orbax.checkpoint")
    proc = subprocess.run(
        [sys.executable, str(_path)], capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    out = proc.stdout
    assert "FAIL" not in out
    n = len(train_transformer.LAYOUTS)
    assert out.count("ok    checkpoint restored into the rules' shardings") == n
    assert out.count("ok    resumed from step 30") == n
    assert "all checks passed" in out


@pytest.mark.slow
def test_script_checks_itself_on_a_busy_machine():
    # Issue 52: with every core busy, JAX 0.10.2's CPU client deadlocked in the fsdp
    # layout's comparison of the resumed and the uninterrupted state, and XLA aborted
    # the run after 40 s (SIGABRT; upstream/jax-reports/cpu-inflight-limit-deadlock).
    # One layout, so that the run stays within minutes on a loaded machine.
    pytest.importorskip("orbax.checkpoint")
    busy = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(os.cpu_count() or 2)
    ]
    try:
        proc = subprocess.run(
            [sys.executable, str(_path), "--layout", "fsdp"],
            capture_output=True,
            text=True,
            timeout=1800,
        )
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    out = proc.stdout
    assert "FAIL" not in out
    assert out.count("ok    checkpoint restored into the rules' shardings") == 1
    assert out.count("ok    resumed from step 30: losses and final state") == 1
    assert "all checks passed" in out


@pytest.mark.parametrize("name", train_transformer.LAYOUTS)
def test_each_layout_runs_or_says_why_not(name):
    # Every count of the devices present: a layout that `unavailable` allows builds
    # its mesh over exactly those devices; the others are refused, saying why.
    allowed = []
    for n in range(1, jax.device_count() + 1):
        why = train_transformer.unavailable(name, n, CFG)
        if why is None:
            layout = train_transformer.make_layout(name, jax.devices()[:n])
            assert list(layout.mesh.devices.flat) == jax.devices()[:n]
            allowed.append(n)
        else:
            assert f"{n} present" in why or "split over" in why, why
    expected = {"2d": [2, 4, 8], "pipeline": [4, 8]}.get(name, [1, 2, 4, 8])
    assert allowed == [n for n in expected if n <= jax.device_count()]


@pytest.mark.slow
def test_script_runs_the_layouts_that_one_device_allows():
    # On one device (one accelerator chip) the script ran `data`, then crashed
    # building the `2d` mesh (`IndexError` in `jax.make_mesh`): each layout that the
    # devices allow runs, and each other says why it is skipped.
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    args = ["--devices", "1", "--steps", "2", "--no-checkpoint"]
    proc = subprocess.run(
        [sys.executable, str(_path), *args],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    out = proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    for name in ("data", "fsdp", "tensor"):
        assert f"=== layout: {name} " in out, out[-4000:]
    assert "skipped 2d: needs an even number of devices; 1 present" in out
    assert (
        "skipped pipeline: needs a multiple of 4 devices (4 stages); 1 present" in out
    )
    # Two steps are too few to reach `MAX_FINAL_LOSS`: that check alone fails.
    fails = [line for line in out.splitlines() if line.startswith("FAIL ")]
    assert len(fails) == 3 and all("final loss" in line for line in fails), out
    assert proc.returncode == 1, out[-4000:]
