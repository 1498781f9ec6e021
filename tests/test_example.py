"""The main example, examples/train_digits.py: each layout trains for a few epochs, and
is checked leaf by leaf against the layout it promises, and step by step against an
unsharded single-device run."""

import importlib.util
import pathlib
import re

import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P


# The example trains on 8 devices.
pytestmark = pytest.mark.devices(8)


_path = pathlib.Path(__file__).parent.parent / "examples" / "train_digits.py"
_spec = importlib.util.spec_from_file_location("train_digits", _path)
assert _spec is not None and _spec.loader is not None
train_digits = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_digits)

EPOCHS = 3
WIDTH = 128

# Written out by hand (not computed by the example's own rules): the sharding of every
# parameter of `eqx.nn.MLP(64, 10, 128, depth=2)`, by key path.
EXPECTED = {
    "data": {
        ".layers[0].weight": P(),
        ".layers[0].bias": P(),
        ".layers[1].weight": P(),
        ".layers[1].bias": P(),
        ".layers[2].weight": P(),
        ".layers[2].bias": P(),
    },
    # The largest dimension divisible by 8; (10,) divides by nothing.
    "fsdp": {
        ".layers[0].weight": P("data", None),  # (128, 64)
        ".layers[0].bias": P("data"),  # (128,)
        ".layers[1].weight": P("data", None),  # (128, 128)
        ".layers[1].bias": P("data"),  # (128,)
        ".layers[2].weight": P(None, "data"),  # (10, 128)
        ".layers[2].bias": P(),  # (10,)
    },
    "tensor": {
        ".layers[0].weight": P("model", None),
        ".layers[0].bias": P("model"),
        ".layers[1].weight": P(None, "model"),
        ".layers[1].bias": P(),
        ".layers[2].weight": P(),
        ".layers[2].bias": P(),
    },
}
MESH_SHAPES = {
    "data": {"data": 8},
    "fsdp": {"data": 8},
    "tensor": {"data": 4, "model": 2},
}


@pytest.fixture(autouse=True, scope="module")
def standard_promotion():
    # conftest.py asks for strict dtype promotion; optax's Adam computes `b1**count`
    # (a float to an int32 power), which only standard promotion allows.
    with jax.numpy_dtype_promotion("standard"):
        yield


@pytest.fixture(scope="module")
def data():
    return train_digits.load_data(seed=0)


@pytest.fixture(scope="module")
def reference(data):
    layout = train_digits.make_layout("single", jax.devices()[:1])
    return train_digits.train(layout, data, epochs=EPOCHS, width=WIDTH)


def _check_params(tree, mesh, expected: dict) -> None:
    """Every array leaf of `tree` (a model, or a parameter-shaped part of the optimiser
    state) is committed to `NamedSharding(mesh, expected[key path])`, and every key path
    in `expected` is present."""
    seen = set()
    for path, leaf in jtu.tree_flatten_with_path(tree)[0]:
        if not eqx.is_array(leaf):
            continue
        key = jtu.keystr(path)
        seen.add(key)
        sharding = NamedSharding(mesh, expected[key])
        assert leaf.committed, key
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim), (
            key,
            leaf.sharding,
            sharding,
        )
    assert seen == set(expected)


@pytest.mark.parametrize("name", train_digits.LAYOUTS)
def test_layout(name, data, reference):
    devices = jax.devices()
    assert len(devices) == 8
    layout = train_digits.make_layout(name, devices, train_digits.make_model(0, WIDTH))
    assert dict(layout.mesh.shape) == MESH_SHAPES[name]
    placed = []
    epoch_losses = []
    result = train_digits.train(
        layout,
        data,
        epochs=EPOCHS,
        width=WIDTH,
        on_start=lambda model, opt_state: placed.append((model, opt_state)),
        on_epoch=lambda epoch, loss: epoch_losses.append((epoch, loss)),
    )
    expected = EXPECTED[name]
    mesh = layout.mesh

    # Where the initial state was placed, and where the trained state is.
    ((model0, opt_state0),) = placed
    for model, opt_state in ((model0, opt_state0), (result.model, result.opt_state)):
        _check_params(model, mesh, expected)
        adam, empty = opt_state
        assert isinstance(adam, optax.ScaleByAdamState)
        assert isinstance(empty, optax.EmptyState)
        _check_params(adam.mu, mesh, expected)
        _check_params(adam.nu, mesh, expected)
        count = adam.count
        assert isinstance(count, jax.Array)
        assert count.sharding.is_equivalent_to(NamedSharding(mesh, P()), 0)
    assert result.model.activation is model0.activation is jax.nn.relu

    # The model and the optimiser state were donated to the first step.
    for leaf in jtu.tree_leaves((model0, opt_state0)):
        if eqx.is_array(leaf):
            assert leaf.is_deleted()

    # Compiled once; each epoch reported.
    assert result.trace_counts == {"train_step": 1, "num_correct": 1}
    assert [epoch for epoch, _ in epoch_losses] == list(range(EPOCHS))

    # The same trajectory as the unsharded run, step by step.
    steps_per_epoch = len(data[0]) // 64
    assert result.losses.shape == reference.losses.shape == (EPOCHS * steps_per_epoch,)
    np.testing.assert_allclose(
        result.losses,
        reference.losses,
        rtol=train_digits.LOSS_RTOL,
        atol=train_digits.LOSS_ATOL,
    )
    assert train_digits.losses_match(result.losses, reference.losses)
    assert result.losses[-1] < 0.5 * result.losses[0]
    np.testing.assert_allclose(
        [loss for _, loss in epoch_losses],
        result.losses.reshape(EPOCHS, steps_per_epoch).mean(axis=1),
        rtol=1e-6,
    )
    assert result.accuracy == pytest.approx(reference.accuracy)


def test_reference_is_single_device(reference):
    device = jax.devices()[0]
    for leaf in jtu.tree_leaves((reference.model, reference.opt_state)):
        if eqx.is_array(leaf):
            assert leaf.sharding.device_set == {device}
    assert reference.trace_counts == {"train_step": 1, "num_correct": 1}


def test_losses_match_rejects():
    losses = np.linspace(2.0, 0.1, 10)
    assert train_digits.losses_match(losses, losses + 0.5 * train_digits.LOSS_ATOL)
    assert not train_digits.losses_match(losses, losses + 0.01)
    assert not train_digits.losses_match(losses, losses[:-1])


def test_main_passes(capsys):
    # 5 epochs are enough to pass the accuracy check (0.961); the default is 20.
    assert train_digits.main(["--layout", "fsdp", "--epochs", "5"]) == 0
    out = capsys.readouterr().out
    assert "Mesh('data': 8" in out
    assert "model.layers[2].weight  (10, 128)   float32  P(None, 'data')" in out
    assert "epoch   5/5" in out
    assert "FAIL" not in out
    assert out.rstrip().endswith("all checks passed")


def test_main_fails_below_accuracy_threshold(capsys):
    # With a learning rate of 0 the losses still match, but nothing is learnt.
    argv = ["--layout", "data", "--epochs", "1", "--learning-rate", "0"]
    assert train_digits.main(argv) == 1
    out = capsys.readouterr().out
    assert "FAIL test accuracy" in out
    assert "ok   per-step losses match" in out


def test_docs_page_runs(capsys):
    # The code blocks of docs/examples/parallelism.md, top to bottom, are a program.
    page = _path.parent.parent / "docs" / "examples" / "parallelism.md"
    blocks = re.findall(r"^```python\n(.*?)^```", page.read_text(), re.S | re.M)
    assert len(blocks) >= 8
    code = "\n".join(blocks)
    assert 'layout = "fsdp"' in code and "for epoch in range(20):" in code
    code = code.replace("for epoch in range(20):", "for epoch in range(5):")
    with jax.set_mesh(None):  # The page sets a global mesh; undo it afterwards.
        exec(compile(code, str(page), "exec"), {"__name__": "docs_page"})
    out = capsys.readouterr().out
    assert "model.layers[2].weight  (10, 128)   float32  P(None, 'data')" in out
    assert "epoch  5" in out
    (accuracy,) = re.findall(r"test accuracy: (\S+)", out)
    assert float(accuracy) >= train_digits.MIN_ACCURACY
