"""Sharded training of an Equinox classifier on scikit-learn's handwritten digits.

Trains an MLP on `sklearn.datasets.load_digits` (1,797 8x8 images, shipped inside
scikit-learn: no download) across every device there is, in one of three layouts:

- `data`:   data parallel: the batch is split over the `data` mesh axis and the
            parameters are replicated;
- `fsdp`:   fully sharded data parallel: as `data`, and the parameters and the optimiser
            state are split over `data` too, along whichever dimension divides evenly;
- `tensor`: a 2-D `data x model` mesh: the batch is split over `data`, and the two
            hidden layers are split over `model` (Megatron-style column- then
            row-parallel).

On a CPU-only machine it simulates 8 devices (`--devices N` or the environment
variable `JAX_NUM_CPU_DEVICES` changes that). Then it checks itself: the sharded run's
losses must match an unsharded single-device run from the same seed, the training step
must have been traced exactly once, and the held-out accuracy must be at least 0.95.
It exits with status 1 if any check fails.

Run `python examples/train_digits.py --help` for the options.
"""

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import equinox as eqx
import equinox_shard as eqxs
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from jax.sharding import AxisType, PartitionSpec as P
from rich.console import Console
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split


LAYOUTS = ("data", "fsdp", "tensor")
# The sharded and the single-device runs add up the same numbers in a different order
# (per-device partial sums, then an all-reduce), so their float32 losses may differ in
# the last bits, and the difference can grow over training. Measured on 8 simulated CPU
# devices: at most 5e-7 over the 440 steps of the default run, in every layout.
LOSS_RTOL = 1e-3
LOSS_ATOL = 1e-4
MIN_ACCURACY = 0.95


#
# Data.
#


def load_data(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The digits as float32 pixels in [0, 1] and int32 labels, split 80/20 (stratified)
    into a training set and a held-out test set."""
    x, y = load_digits(return_X_y=True)
    x = (np.asarray(x) / 16.0).astype(np.float32)
    y = np.asarray(y).astype(np.int32)
    x_train, x_test, y_train, y_test = map(
        np.asarray, train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
    )
    return x_train, y_train, x_test, y_test


def batches(
    x: np.ndarray, y: np.ndarray, batch_size: int, *, seed: int, epoch: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """One epoch of shuffled minibatches, in NumPy; the last, incomplete one is dropped
    so that every batch has the same shape (and the step compiles once)."""
    perm = np.random.default_rng((seed, epoch)).permutation(len(x))
    for start in range(0, len(x) - batch_size + 1, batch_size):
        index = perm[start : start + batch_size]
        yield x[index], y[index]


#
# Model, loss, and the two JIT'd functions.
#


def make_model(seed: int, width: int) -> eqx.nn.MLP:
    return eqx.nn.MLP(64, 10, width, depth=2, key=jr.key(seed))


def loss_fn(model: eqx.nn.MLP, x: jax.Array, y: jax.Array) -> jax.Array:
    logits = jax.vmap(model)(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where everything lives. Each field is a specification in `equinox_shard`'s
    language: a PyTree prefix whose leaves are shardings, devices, bare
    `PartitionSpec`s (resolved against `mesh`), or callables `leaf -> spec`."""

    name: str
    mesh: jax.sharding.Mesh | None  # None: a single device, no mesh.
    params: Any  # a prefix of the model
    batch: Any  # for each of `x` and `y`
    replicated: Any  # for the scalars: Adam's step count, the loss


def make_layout(
    name: str, devices: Sequence, model: eqx.nn.MLP | None = None
) -> Layout:
    """One of the three parallel layouts over `devices`, or `"single"`: the unsharded
    reference on one device. `"tensor"` needs the `model`, to name its layers."""
    if name == "single":
        (device,) = devices
        return Layout(name, None, device, device, device)

    if name == "tensor":
        n_model = 2 if len(devices) % 2 == 0 else 1
        shape, axes = (len(devices) // n_model, n_model), ("data", "model")
    else:
        shape, axes = (len(devices),), ("data",)
    # Auto axes: we say where the inputs and outputs of the step live, and XLA's
    # partitioner works out everything in between. See the docs page for why.
    mesh = jax.make_mesh(
        shape, axes, axis_types=(AxisType.Auto,) * len(axes), devices=devices
    )

    if name == "data":
        params = P()  # replicated

    elif name == "fsdp":
        n_data = mesh.shape["data"]

        def fsdp(leaf):
            # Split the largest dimension that divides evenly; replicate the rest.
            for dim in sorted(range(leaf.ndim), key=lambda d: -leaf.shape[d]):
                if leaf.shape[dim] % n_data == 0:
                    return P(*[None] * dim, "data")
            return P()

        params = fsdp  # called on each array leaf

    elif name == "tensor":
        if model is None:
            raise ValueError("The tensor-parallel layout needs the model.")
        # Column-parallel then row-parallel (as in Megatron-LM): the hidden activations
        # are split over `model` in between; one all-reduce after the second layer.
        params = jax.tree.map(lambda _: P(), eqx.filter(model, eqx.is_array))
        params = eqx.tree_at(
            lambda m: (m.layers[0].weight, m.layers[0].bias, m.layers[1].weight),
            params,
            (P("model", None), P("model"), P(None, "model")),
        )

    else:
        raise ValueError(f"Unknown layout {name!r}; expected one of {LAYOUTS}.")
    return Layout(name, mesh, params, P("data"), P())


def opt_state_spec(optim, opt_state, params, layout: Layout):
    """The optimiser state's specification: each copy of the parameters inside it
    (Adam's two moments) is laid out like the parameters; the rest (the step count) is
    replicated."""
    # Broadcast the (prefix) specification to one spec leaf per parameter ...
    per_param = jax.tree.map(
        lambda spec, sub: jax.tree.map(lambda _: spec, sub), layout.params, params
    )
    # ... and put it wherever optax keeps a parameter-shaped tree.
    return optax.tree_map_params(
        optim,
        lambda _, spec: spec,
        opt_state,
        per_param,
        transform_non_params=lambda _: layout.replicated,
    )


def make_functions(layout: Layout, optim, opt_spec, trace_counts: dict[str, int]):
    """The training step and the evaluation, JIT'd with this layout's shardings."""

    @eqxs.filter_jit(
        in_shardings=(layout.params, opt_spec, layout.batch, layout.batch),
        out_shardings=(layout.params, opt_spec, layout.replicated),
        # The step returns a new model and optimiser state, so their old buffers can be
        # reused in place. (The batch is donated too; nothing reads it afterwards.)
        donate="all",
    )
    def train_step(model, opt_state, x, y):
        trace_counts["train_step"] += 1  # Python side effect: runs once per trace.
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        # Pin the gradients to the parameters' layout, so that the optimiser update
        # runs shard by shard. (XLA infers the same layout here; this makes sure.)
        grads = eqxs.filter_shard(grads, layout.params)
        updates, opt_state = optim.update(
            grads, opt_state, eqx.filter(model, eqx.is_inexact_array)
        )
        model = eqx.apply_updates(model, updates)
        return model, opt_state, loss

    @eqxs.filter_jit(
        in_shardings=(layout.params, layout.batch, layout.batch),
        out_shardings=layout.replicated,
    )
    def num_correct(model, x, y):
        trace_counts["num_correct"] += 1
        logits = jax.vmap(model)(x)
        return jnp.sum(jnp.argmax(logits, axis=-1) == y)

    return train_step, num_correct


#
# Training.
#


@dataclasses.dataclass
class Result:
    model: eqx.nn.MLP
    opt_state: Any
    losses: np.ndarray  # one per step
    accuracy: float
    trace_counts: dict[str, int]
    seconds: float


def pad_to_multiple(x: np.ndarray, multiple: int, value) -> np.ndarray:
    extra = -len(x) % multiple
    return np.concatenate([x, np.full((extra, *x.shape[1:]), value, x.dtype)])


def train(
    layout: Layout,
    data: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    *,
    seed: int = 0,
    epochs: int = 20,
    batch_size: int = 64,
    width: int = 128,
    learning_rate: float = 3e-3,
    on_epoch: Callable[[int, float], None] | None = None,
    on_start: Callable[[eqx.nn.MLP, Any], None] | None = None,
) -> Result:
    """Trains from scratch in `layout`, and evaluates on the held-out set."""
    x_train, y_train, x_test, y_test = data
    optim = optax.adam(learning_rate)
    trace_counts = {"train_step": 0, "num_correct": 0}
    model = make_model(seed, width)
    params = eqx.filter(model, eqx.is_inexact_array)
    opt_state = optim.init(params)
    opt_spec = opt_state_spec(optim, opt_state, params, layout)
    train_step, num_correct = make_functions(layout, optim, opt_spec, trace_counts)
    # A batch must split evenly over the `data` axis: pad the test set with label -1
    # (never predicted, so never counted as correct).
    n_test = len(y_test)
    n_data = 1 if layout.mesh is None else layout.mesh.shape["data"]
    x_test = pad_to_multiple(x_test, n_data, 0.0)
    y_test = pad_to_multiple(y_test, n_data, -1)

    start = time.perf_counter()
    # Bare `PartitionSpec`s in the specifications refer to this mesh (None: no mesh).
    with jax.set_mesh(layout.mesh):
        # Place the model and the optimiser state: one batched `jax.device_put`. Their
        # non-array leaves (the MLP's activation functions) are left alone.
        model, opt_state = eqxs.filter_device_put(
            (model, opt_state), (layout.params, opt_spec)
        )
        if on_start is not None:
            on_start(model, opt_state)
        losses = []
        for epoch in range(epochs):
            epoch_losses = []
            for x, y in batches(x_train, y_train, batch_size, seed=seed, epoch=epoch):
                x, y = eqxs.filter_device_put((x, y), layout.batch)
                model, opt_state, loss = train_step(model, opt_state, x, y)
                epoch_losses.append(loss)
            epoch_losses = [float(loss) for loss in epoch_losses]  # waits for them
            losses.extend(epoch_losses)
            if on_epoch is not None:
                on_epoch(epoch, float(np.mean(epoch_losses)))
        x_test, y_test = eqxs.filter_device_put((x_test, y_test), layout.batch)
        accuracy = int(num_correct(model, x_test, y_test)) / n_test
    return Result(
        model,
        opt_state,
        np.asarray(losses),
        accuracy,
        trace_counts,
        time.perf_counter() - start,
    )


def losses_match(sharded: np.ndarray, reference: np.ndarray) -> bool:
    return sharded.shape == reference.shape and bool(
        np.allclose(sharded, reference, rtol=LOSS_RTOL, atol=LOSS_ATOL)
    )


#
# Command line.
#


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],  # pyright: ignore[reportOptionalMemberAccess]
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--layout",
        choices=(*LAYOUTS, "all"),
        default="all",
        help="how to shard; 'all' runs the three one after the other",
    )
    parser.add_argument(
        "--devices",
        type=int,
        default=None,
        help="number of CPU devices to simulate (default: $JAX_NUM_CPU_DEVICES, else "
        "8); on GPU/TPU, use the first N accelerators (default: all of them)",
    )
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--width", type=int, default=128, help="hidden layer width")
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def select_devices(n: int | None) -> list:
    """Simulates `n` CPU devices (default 8) if there is no accelerator. Must run before
    any JAX computation: the CPU backend reads `jax_num_cpu_devices` when it starts."""
    if n is None:
        jax.config.update(
            "jax_num_cpu_devices", int(os.environ.get("JAX_NUM_CPU_DEVICES", 8))
        )
        return jax.devices()
    jax.config.update("jax_num_cpu_devices", n)
    devices = jax.devices()
    if n > len(devices):
        raise SystemExit(f"--devices {n}: only {len(devices)} devices available.")
    return devices[:n]


def describe_mesh(mesh: jax.sharding.Mesh) -> str:
    """The mesh, and which device sits where in it."""
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    grid = np.array2string(ids, prefix="device ids: ")
    return f"{mesh}\ndevice ids: {grid}"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    devices = select_devices(args.devices)
    console = Console(highlight=False, soft_wrap=True)
    data = load_data(args.seed)
    x_train, _, x_test, _ = data
    console.print(
        f"[bold]{len(devices)} {devices[0].platform.upper()} devices[/bold]; digits: "
        f"{len(x_train)} training and {len(x_test)} held-out images"
    )
    hyperparameters = dict(
        seed=args.seed,
        epochs=args.epochs,
        width=args.width,
        learning_rate=args.learning_rate,
    )
    failures = []
    references = {}
    for name in LAYOUTS if args.layout == "all" else (args.layout,):
        layout = make_layout(name, devices, make_model(args.seed, args.width))
        assert layout.mesh is not None
        # Round the batch up to a multiple of the `data` axis, so that it splits evenly.
        n_data = layout.mesh.shape["data"]
        batch_size = -(-args.batch_size // n_data) * n_data
        console.rule(f"[bold]layout: {name}")
        console.print(describe_mesh(layout.mesh), markup=False)
        console.print(f"batch size {batch_size}: {batch_size // n_data} per data shard")

        def on_start(model, opt_state):
            console.print(eqxs.sharding_table(model, name="model"), markup=False)

        start = time.perf_counter()

        def on_epoch(epoch, loss):
            elapsed = time.perf_counter() - start
            console.print(
                f"epoch {epoch + 1:3d}/{args.epochs}  loss {loss:.4f}  "
                f"({elapsed:.1f} s)"
            )

        result = train(
            layout,
            data,
            batch_size=batch_size,
            on_start=on_start,
            on_epoch=on_epoch,
            **hyperparameters,
        )
        if batch_size not in references:
            single = make_layout("single", devices[:1])
            references[batch_size] = reference = train(
                single, data, batch_size=batch_size, **hyperparameters
            )
            console.print(
                f"single-device reference run: {reference.seconds:.1f} s, test "
                f"accuracy {reference.accuracy:.4f}"
            )
        reference = references[batch_size]
        error = float(np.max(np.abs(result.losses - reference.losses)))
        checks = {
            f"test accuracy {result.accuracy:.4f} >= {MIN_ACCURACY}": (
                result.accuracy >= MIN_ACCURACY
            ),
            f"per-step losses match the single-device run: max |diff| {error:.1e} "
            f"(tolerance atol={LOSS_ATOL} + rtol={LOSS_RTOL} * |loss|)": losses_match(
                result.losses, reference.losses
            ),
            "compiled once: train_step traced "
            f"{result.trace_counts['train_step']}x, num_correct traced "
            f"{result.trace_counts['num_correct']}x": (
                result.trace_counts == {"train_step": 1, "num_correct": 1}
            ),
        }
        for text, ok in checks.items():
            console.print(("[green]ok[/green]   " if ok else "[red]FAIL[/red] ") + text)
            if not ok:
                failures.append(f"{name}: {text}")

    console.rule()
    if failures:
        console.print("[bold red]FAILED[/bold red]\n" + "\n".join(failures))
        return 1
    console.print("[bold green]all checks passed[/bold green]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
