"""A small decoder-only transformer language model, trained on 8 devices, 5 layouts.

The corpus is the Python standard library's own source code (the `.py` files next to
`os.py`), read as bytes: no download. The model predicts the next byte.

Each layout is a mesh (Auto axes: we say where the inputs and outputs of the step live,
and XLA's partitioner works out everything in between) and one `eqxs.PathRules`, which
places the parameters *and* the optimiser state (an Adam moment's key path ends like
its parameter's: `[0].mu.blocks.mlp_in.weight`):

- `data`:   data parallel: the batch is split over `data`; everything else replicated;
- `fsdp`:   fully sharded data parallel: as `data`, and every large weight is split
            over `data` too;
- `tensor`: tensor parallel over `model` (Megatron-style: one attention head per
            device, the MLP column- then row-parallel); the batch is replicated;
- `2d`:     a 4 x 2 `data x model` mesh: the batch over `data`, tensor parallel over
            `model`;
- `pipeline`: a 4 x 2 `stage x data` mesh: the stacked blocks split over `stage`
            (one block per device) and run by `eqxs.filter_pipeline` in 8
            microbatches; the batch over `data`.

The model and its optimiser state are created directly sharded (`filter_eval_shape`
to plan, then `filter_jit(init, out_shardings=rules)`); the loss reduction runs in
`eqxs.filter_shard_map`; halfway through, a checkpoint is written in the background by
an `eqxs.CheckpointManager` (orbax-checkpoint's, underneath) while the next steps
donate the state, restored from the latest step straight into the target shardings,
and training resumes from it.

It checks itself, and exits with status 1 if any check fails: every layout's per-step
losses match an unsharded single-device run; the step was traced once; the final loss
is below `MAX_FINAL_LOSS`; the run resumed from the checkpoint gives bit-identical
losses and parameters.

On other device counts (`--devices N`; one accelerator chip) it runs each layout whose
mesh the devices allow, and says which it skips and why (on one device: `2d` and
`pipeline`).

    python examples/train_transformer.py [--layout data|fsdp|tensor|2d|pipeline|all]
"""

import argparse
import dataclasses
import os
import pathlib
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import equinox_shard as eqxs
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import optax
from jax.sharding import AxisType, PartitionSpec as P


LAYOUTS = ("data", "fsdp", "tensor", "2d", "pipeline")
# The sharded runs add the same numbers in another order than the single-device run,
# so float32 losses differ in the last bits. Measured on 8 simulated CPU devices: at
# most 2e-6 (relative) over the default run, in every layout.
LOSS_RTOL = 1e-4
# ln(256) = 5.55 is a uniform guess over bytes; the default run reaches about 2.6.
MAX_FINAL_LOSS = 3.0


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 256  # bytes
    length: int = 64
    width: int = 64
    heads: int = 8
    depth: int = 4  # divisible by the 4 stages of the `pipeline` layout
    hidden: int = 256
    batch: int = 16
    microbatches: int = 8  # the `pipeline` layout's
    remat: bool = False  # the `pipeline` layout's: `jax.checkpoint` each stage's work
    steps: int = 60
    learning_rate: float = 3e-3
    seed: int = 0


#
# Data: the standard library's source, as bytes.
#


def load_corpus(max_bytes: int = 2_000_000) -> np.ndarray:
    root = pathlib.Path(os.__file__).parent
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)


def get_batch(corpus: np.ndarray, cfg: Config, step: int) -> tuple:
    """Random windows of `length + 1` bytes: inputs and next-byte targets."""
    rng = np.random.default_rng((cfg.seed, step))
    starts = rng.integers(0, len(corpus) - cfg.length - 1, cfg.batch)
    windows = np.stack([corpus[s : s + cfg.length + 1] for s in starts])
    windows = windows.astype(np.int32)
    return windows[:, :-1], windows[:, 1:]


#
# Model: pre-norm blocks, stacked along a leading axis and run with `jax.lax.scan`.
#


class Block(eqx.Module):
    norm1: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    mlp_in: eqx.nn.Linear
    mlp_out: eqx.nn.Linear

    def __init__(self, cfg: Config, key):
        k1, k2, k3 = jr.split(key, 3)
        self.norm1 = eqx.nn.LayerNorm(cfg.width)
        self.attention = eqx.nn.MultiheadAttention(cfg.heads, cfg.width, key=k1)
        self.norm2 = eqx.nn.LayerNorm(cfg.width)
        self.mlp_in = eqx.nn.Linear(cfg.width, cfg.hidden, key=k2)
        self.mlp_out = eqx.nn.Linear(cfg.hidden, cfg.width, key=k3)

    def __call__(self, x, mask):
        h = jax.vmap(self.norm1)(x)
        x = x + self.attention(h, h, h, mask=mask)
        h = jax.vmap(self.norm2)(x)
        return x + jax.vmap(self.mlp_out)(jax.nn.gelu(jax.vmap(self.mlp_in)(h)))


class Transformer(eqx.Module):
    embedding: eqx.nn.Embedding
    position: jax.Array
    blocks: Block  # every array has a leading axis of size `depth`
    norm: eqx.nn.LayerNorm
    unembed: eqx.nn.Linear

    def __init__(self, cfg: Config, key):
        k1, k2, k3, k4 = jr.split(key, 4)
        self.embedding = eqx.nn.Embedding(cfg.vocab, cfg.width, key=k1)
        self.position = 0.02 * jr.normal(k2, (cfg.length, cfg.width))
        self.blocks = eqx.filter_vmap(lambda k: Block(cfg, k))(jr.split(k3, cfg.depth))
        self.norm = eqx.nn.LayerNorm(cfg.width)
        self.unembed = eqx.nn.Linear(cfg.width, cfg.vocab, use_bias=False, key=k4)

    def __call__(self, tokens):
        x = jax.vmap(self.embedding)(tokens) + self.position
        mask = jnp.tril(jnp.ones((len(tokens), len(tokens)), dtype=bool))
        arrays, static = eqx.partition(self.blocks, eqx.is_array)

        def layer(x, block_arrays):
            return eqx.combine(block_arrays, static)(x, mask), None

        x, _ = jax.lax.scan(layer, x, arrays)
        return jax.vmap(self.unembed)(jax.vmap(self.norm)(x))

    def pipelined(self, tokens, *, microbatches: int, remat: bool = False):
        """`jax.vmap(self)(tokens)` for a batch of sequences, with the blocks run as a
        pipeline over the mesh axis `stage`: the same numbers."""
        x = jax.vmap(lambda t: jax.vmap(self.embedding)(t) + self.position)(tokens)
        mask = jnp.tril(jnp.ones((tokens.shape[1], tokens.shape[1]), dtype=bool))

        def block(block, x, mask):  # `x`: one microbatch of sequences
            return jax.vmap(lambda sequence: block(sequence, mask))(x)

        # The mask goes in as an argument (a closed-over traced array would be
        # outside the pipeline's `jax.shard_map`).
        fn = eqx.Partial(block, mask=mask)
        x = eqxs.filter_pipeline(
            self.blocks, x, microbatches=microbatches, fn=fn, remat=remat
        )
        return jax.vmap(jax.vmap(self.unembed))(jax.vmap(jax.vmap(self.norm))(x))


#
# Layouts, written as path rules.
#


def tensor_rules(axis: str) -> list:
    """Megatron-style: query/key/value column-parallel (whole heads per device), the
    attention output and the MLP's second layer row-parallel, the vocabulary split in
    the (un)embedding. The leading `None` of the blocks is the stacked layer axis."""
    return [
        (r"embedding\.weight$", P(None, axis)),
        (r"blocks\.attention\.(query|key|value)_proj\.weight$", P(None, axis, None)),
        (r"blocks\.attention\.output_proj\.weight$", P(None, None, axis)),
        (r"blocks\.mlp_in\.weight$", P(None, axis, None)),
        (r"blocks\.mlp_in\.bias$", P(None, axis)),
        (r"blocks\.mlp_out\.weight$", P(None, None, axis)),
        (r"unembed\.weight$", P(axis, None)),
    ]


FSDP_RULES = [
    # Every weight matrix split over `data` along a dimension that divides by 8.
    (r"embedding\.weight$", P("data", None)),
    (r"position$", P("data", None)),
    (r"blocks\.attention\.\w+_proj\.weight$", P(None, "data", None)),
    (r"blocks\.mlp_in\.weight$", P(None, "data", None)),
    (r"blocks\.mlp_out\.weight$", P(None, None, "data")),
    (r"unembed\.weight$", P("data", None)),
]


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    mesh: jax.sharding.Mesh
    rules: eqxs.PathRules  # for the model and the optimiser state
    batch: P  # for the tokens and the targets
    batch_axes: tuple[str, ...]  # the mesh axes the batch is split over
    pipelined: bool = False  # the blocks run by `filter_pipeline` over `stage`


def unavailable(name: str, n: int, cfg: Config) -> str | None:
    """Why layout `name` cannot run on `n` devices (`None` if it can): each mesh axis
    must divide what it splits."""
    if name == "2d" and n % 2:
        return f"needs an even number of devices; {n} present"
    if name == "pipeline" and n % 4:
        return f"needs a multiple of 4 devices (4 stages); {n} present"
    data = {"data": n, "fsdp": n, "2d": n // 2, "pipeline": n // 4}.get(name, 1)
    if cfg.batch % data:
        return f"the batch of {cfg.batch} does not split over {data} devices"
    if name == "tensor" and cfg.heads % n:
        return f"{cfg.heads} heads do not split over {n} devices"
    return None


def make_layout(name: str, devices: Sequence) -> Layout:
    if name == "single":
        shape, axes = (1,), ("data",)
        devices = devices[:1]
    elif name == "2d":
        shape, axes = (len(devices) // 2, 2), ("data", "model")
    elif name == "tensor":
        shape, axes = (len(devices),), ("model",)
    elif name == "pipeline":
        shape, axes = (4, len(devices) // 4), ("stage", "data")
    else:
        shape, axes = (len(devices),), ("data",)
    mesh = jax.make_mesh(
        shape, axes, axis_types=(AxisType.Auto,) * len(axes), devices=devices
    )
    if name in ("single", "data"):
        rules, batch_axes = [], ("data",)
    elif name == "fsdp":
        rules, batch_axes = FSDP_RULES, ("data",)
    elif name == "tensor":
        rules, batch_axes = tensor_rules("model"), ()
    elif name == "2d":
        rules, batch_axes = tensor_rules("model"), ("data",)
    elif name == "pipeline":
        # Each stage holds its blocks (and their Adam moments): the layer axis over
        # `stage`. The rest is replicated, data parallel over `data`.
        rules, batch_axes = [(r"blocks\.", P("stage"))], ("data",)
    else:
        raise ValueError(f"Unknown layout {name!r}; expected one of {LAYOUTS}.")
    # Everything else (biases, norms, Adam's step count) is replicated.
    path_rules = eqxs.PathRules(rules, default=P())
    batch = P(batch_axes or None)
    return Layout(name, mesh, path_rules, batch, batch_axes, name == "pipeline")


#
# Training.
#


def mean_loss(per_token: jax.Array, layout: Layout) -> jax.Array:
    """The mean of the per-token losses: each device sums its own block, then one
    `psum` over the batch axes adds the partial sums."""

    @eqxs.filter_shard_map(in_specs=layout.batch, out_specs=P())
    def reduce(block):
        total = jnp.sum(block)
        if layout.batch_axes:
            total = jax.lax.psum(total, layout.batch_axes)
        return total / per_token.size

    return reduce(per_token)


def make_functions(layout: Layout, cfg: Config, trace_counts: dict):
    optim = optax.adamw(cfg.learning_rate)
    rules = layout.rules

    def init(key):
        model = Transformer(cfg, key)
        return model, optim.init(eqx.filter(model, eqx.is_inexact_array))

    # Created straight into its shardings: no array is ever whole on one device.
    init_sharded = eqxs.filter_jit(init, out_shardings=rules)

    def loss_fn(model, tokens, targets):
        if layout.pipelined:
            logits = model.pipelined(
                tokens, microbatches=cfg.microbatches, remat=cfg.remat
            )
        else:
            logits = jax.vmap(model)(tokens)
        per_token = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        return mean_loss(per_token, layout)

    @eqxs.filter_jit(
        in_shardings=(rules, rules, layout.batch, layout.batch),
        out_shardings=(rules, rules, P()),
        donate="all",
    )
    def train_step(model, opt_state, tokens, targets):
        trace_counts["train_step"] += 1
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, tokens, targets)
        updates, opt_state = optim.update(
            grads, opt_state, eqx.filter(model, eqx.is_inexact_array)
        )
        return eqx.apply_updates(model, updates), opt_state, loss

    return init, init_sharded, train_step


@dataclasses.dataclass
class Result:
    losses: np.ndarray
    resumed_losses: np.ndarray | None
    restored_exactly: bool | None
    same_final_state: bool | None
    trace_counts: dict
    tokens_per_second: float
    seconds: float
    plan: str
    table: str
    moments_follow: bool


def train(layout: Layout, cfg: Config, corpus: np.ndarray, *, resume: bool) -> Result:
    trace_counts = {"train_step": 0}
    init, init_sharded, train_step = make_functions(layout, cfg, trace_counts)
    key = jr.key(cfg.seed)
    shapes = eqx.filter_eval_shape(init, key)  # the plan, before allocating anything
    plan = eqxs.sharding_table(shapes, rules=layout.rules)
    start = time.perf_counter()
    with jax.set_mesh(layout.mesh):
        model, opt_state = init_sharded(key)
        table = eqxs.sharding_table(model, name="model", rules=layout.rules)
        # Adam's moments are placed by the same rules as the parameters they follow.
        params = jtu.tree_leaves(eqx.filter(model, eqx.is_inexact_array))
        adam: Any = opt_state[0]  # pyright: ignore
        moments_follow = all(
            m.sharding == p.sharding
            for moment in (adam.mu, adam.nu)
            for m, p in zip(jtu.tree_leaves(moment), params, strict=True)
        )
        losses, checkpoint, saved = [], cfg.steps // 2, None
        directory = pathlib.Path(tempfile.mkdtemp()) / "checkpoints"
        manager = eqxs.CheckpointManager(directory) if resume else None
        step_start = None
        for step in range(cfg.steps):
            if step == 1:
                jax.block_until_ready(losses[0])
                step_start = time.perf_counter()  # after the compilation
            if manager is not None and step == checkpoint:
                # Copies (a NumPy view would pin the buffers: nothing donated).
                saved = jtu.tree_map(
                    np.array, eqx.filter((model, opt_state), eqx.is_array)
                )
                # Written in the background by each device's process, while the
                # next steps run and donate these very arrays (safe: orbax has
                # copied them off the devices when `save` returns).
                manager.save(step, (model, opt_state), force=True)
            batch = eqxs.filter_device_put(get_batch(corpus, cfg, step), layout.batch)
            model, opt_state, loss = train_step(model, opt_state, *batch)
            losses.append(loss)
        losses = np.asarray([float(x) for x in losses])
        elapsed = time.perf_counter() - (step_start or start)
        tokens_per_second = (cfg.steps - 1) * cfg.batch * cfg.length / elapsed
        resumed_losses = restored_exactly = same_final_state = None
        if manager is not None:
            # Restore straight into the shardings the rules give: `like` is the
            # abstract state (`jax.ShapeDtypeStruct`s carrying those shardings), so
            # nothing is allocated before the checkpoint's shards are read.
            like = init_sharded.eval_shape(key)
            restored = manager.restore(like)  # the latest step, once written
            manager.close()
            arrays = eqx.filter(restored, eqx.is_array)
            restored_exactly = bool(
                jtu.tree_all(
                    jtu.tree_map(
                        np.array_equal, saved, jtu.tree_map(np.asarray, arrays)
                    )
                )
            ) and all(
                x.sharding == y.sharding
                for x, y in zip(
                    jtu.tree_leaves(arrays),
                    jtu.tree_leaves(eqx.filter((model, opt_state), eqx.is_array)),
                )
            )
            resumed_model, resumed_state = restored
            resumed = []
            for step in range(checkpoint, cfg.steps):
                batch = eqxs.filter_device_put(
                    get_batch(corpus, cfg, step), layout.batch
                )
                resumed_model, resumed_state, loss = train_step(
                    resumed_model, resumed_state, *batch
                )
                resumed.append(loss)
            resumed_losses = np.asarray([float(x) for x in resumed])
            # Compared on the host: `eqx.tree_equal` here would launch three small
            # 8-device programs per array back to back, which JAX 0.10.2's CPU client
            # can deadlock on (docs/troubleshooting.md).
            same_final_state = bool(
                jtu.tree_all(
                    jtu.tree_map(
                        np.array_equal,
                        jtu.tree_map(
                            np.asarray,
                            eqx.filter((resumed_model, resumed_state), eqx.is_array),
                        ),
                        jtu.tree_map(
                            np.asarray, eqx.filter((model, opt_state), eqx.is_array)
                        ),
                    )
                )
            )
    return Result(
        losses,
        resumed_losses,
        restored_exactly,
        same_final_state,
        trace_counts,
        tokens_per_second,
        time.perf_counter() - start,
        plan,
        table,
        moments_follow,
    )


#
# Command line.
#


def select_devices(n: int) -> list:
    jax.config.update("jax_num_cpu_devices", n)
    devices = jax.devices()
    if len(devices) < n:
        raise SystemExit(f"--devices {n}: only {len(devices)} devices available.")
    return devices[:n]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])  # pyright: ignore
    parser.add_argument("--layout", choices=(*LAYOUTS, "all"), default="all")
    parser.add_argument("--steps", type=int, default=Config.steps)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--no-checkpoint", action="store_true", help="skip orbax")
    args = parser.parse_args(argv)
    devices = select_devices(args.devices)
    cfg = Config(steps=args.steps)
    corpus = load_corpus()
    print(
        f"{len(devices)} {devices[0].platform.upper()} devices; corpus: "
        f"{len(corpus):,} bytes of the Python standard library; "
        f"{cfg.depth} layers, width {cfg.width}, {cfg.heads} heads, "
        f"batch {cfg.batch} x {cfg.length} tokens, {cfg.steps} steps"
    )
    started = time.perf_counter()
    reference = train(make_layout("single", devices), cfg, corpus, resume=False)
    print(f"single device: final loss {reference.losses[-1]:.4f}")
    failures = []
    summary = []
    names = LAYOUTS if args.layout == "all" else (args.layout,)
    for name in names:
        why = unavailable(name, len(devices), cfg)
        if why is not None and args.layout != "all":
            raise SystemExit(f"--layout {name}: {why}.")
        if why is not None:
            print(f"\nskipped {name}: {why}")
            continue
        layout = make_layout(name, devices)
        result = train(layout, cfg, corpus, resume=not args.no_checkpoint)
        print(f"\n=== layout: {name}  ({layout.mesh.shape_tuple}, Auto axes) ===")
        if not summary:  # the first layout run
            print("plan (filter_eval_shape, before allocating):")
            print(result.plan)
        print("the model, as placed:")
        print(result.table)
        for step in (0, cfg.steps // 2, cfg.steps - 1):
            print(f"step {step + 1:3d}  loss {result.losses[step]:.4f}")
        print(f"{result.tokens_per_second:,.0f} tokens/s ({result.seconds:.1f} s)")

        def check(ok: bool, message: str, name=name):
            print(("ok    " if ok else "FAIL  ") + message)
            if not ok:
                failures.append(f"{name}: {message}")

        difference = np.max(np.abs(result.losses / reference.losses - 1))
        check(
            bool(np.allclose(result.losses, reference.losses, rtol=LOSS_RTOL, atol=0)),
            f"losses match the single-device run (max relative difference "
            f"{difference:.1e}, tolerance {LOSS_RTOL:.0e})",
        )
        check(
            result.moments_follow,
            "Adam's moments are placed like their parameters, by the same rules",
        )
        check(
            result.trace_counts["train_step"] == 1,
            f"the training step was traced {result.trace_counts['train_step']} time(s)"
            " (including after the restore)",
        )
        check(
            result.losses[-1] < MAX_FINAL_LOSS,
            f"final loss {result.losses[-1]:.4f} < {MAX_FINAL_LOSS}",
        )
        if result.resumed_losses is not None:
            half = cfg.steps // 2
            check(
                bool(result.restored_exactly),
                "checkpoint restored into the rules' shardings, bit for bit",
            )
            check(
                np.array_equal(result.resumed_losses, result.losses[half:])
                and bool(result.same_final_state),
                f"resumed from step {half}: losses and final state bit-identical",
            )
        summary.append((name, result.losses[-1], result.tokens_per_second))
    print("\nlayout    final loss  tokens/s")
    for name, loss, tps in summary:
        print(f"{name:8s}  {loss:10.4f}  {tps:8,.0f}")
    print(f"total {time.perf_counter() - started:.1f} s")
    if failures:
        print("\nFAILED:\n  " + "\n  ".join(failures))
        return 1
    print("\nall checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
