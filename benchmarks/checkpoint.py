"""Checkpoints: save and restore a transformer's training state (the model of the
training-step benchmark and its Adam state), fully sharded over the 8 devices (every
weight matrix split along its first dimension), restored into the same shardings.

Variants, each writing its own checkpoint directory every round:

- `eqxs`: `equinox_shard.save(path, state)` and `equinox_shard.restore(path, like)`,
    `like` the abstract state (`jax.ShapeDtypeStruct`s carrying the shardings).
- `orbax`: orbax-checkpoint used directly: a `StandardCheckpointer` saves the dict of
    array leaves (keyed by key path) and restores it into hand-built
    `ShapeDtypeStruct`s with the shardings; the tree is rebuilt from the key paths.
- `eqx`: `equinox.tree_serialise_leaves` (one file, every array gathered to the
    host), then `equinox.tree_deserialise_leaves` onto the default device and
    `equinox_shard.filter_device_put` into the shardings.
- `manager`: `equinox_shard.CheckpointManager` (`save(0, state)`, waited for, and
    `restore(like)`, the latest step).

Training with checkpoints (issue 34): the time of 10 training steps (`filter_jit` with
`donate="all"`, the state sharded as above) that start with a save, against 10 steps
without one: a background save (`CheckpointManager.save`, which returns once orbax has
copied the arrays off the devices), orbax's own background save of the same arrays (an
asynchronous `StandardCheckpointer`, the peer: what building on orbax costs at the
least) and a blocking one (`equinox_shard.save`); the median over rounds of each ratio.

The first restore in a fresh process (issue 44): what every resumed job pays. Each
round, for `eqxs` and `orbax` in turn, a child process (8 CPU devices) builds the
abstract `like` and times only its first restore of the checkpoint written here; the
median over rounds of each and of their ratio.

Reported: the median wall time of a save and of a restore (waited for), the median
over rounds of each variant's time over `orbax`'s, and the peak, over devices, of the
bytes held on one device during a restore (live buffers counted once each, sampled on
another thread: CPU devices have no `memory_stats()`), next to one device's share of
the state.
"""

import collections
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import equinox as eqx
import equinox_shard as eqxs
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import optax

from . import _harness as h, _trees as t
from .step import _batches, _loss, Transformer


VARIANTS = ("eqxs", "orbax", "eqx", "manager")
MODES = ("none", "background", "orbax-background", "blocking")


def _device_bytes() -> dict:
    buffers = {}
    for x in jax.live_arrays():
        try:
            for shard in x.addressable_shards:
                data = shard.data
                if jnp.issubdtype(data.dtype, jax.dtypes.prng_key):
                    # By identity: `key_data` would launch a computation from this
                    # thread, which JAX 0.10.2's CPU client cannot run beside the
                    # main thread's multi-device ones (the abort in docs/benchmarks.md).
                    buffers[("key", id(x), shard.device.id)] = (
                        shard.device.id,
                        data.nbytes,
                    )
                    continue
                buffers[data.unsafe_buffer_pointer()] = (shard.device.id, data.nbytes)
        except Exception:  # deleted meanwhile
            continue
    out = collections.Counter()
    for device, nbytes in buffers.values():
        out[device] += nbytes
    return out


def _peak_during(fn):
    """`fn()`, and the peak bytes held on any one device meanwhile (above those held
    before)."""
    base = _device_bytes()
    peak = collections.Counter()
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            for d, n in _device_bytes().items():
                peak[d] = max(peak[d], n - base.get(d, 0))
            time.sleep(0.0005)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        out = fn()
        jax.block_until_ready(out)
    finally:
        stop.set()
        thread.join()
    return out, max(peak.values(), default=0)


def _state(cfg):
    model = Transformer(
        cfg["vocab"],
        cfg["length"],
        cfg["width"],
        cfg["heads"],
        cfg["depth"],
        key=jr.key(0),
    )
    opt_state = optax.adam(1e-3).init(eqx.filter(model, eqx.is_inexact_array))
    return model, opt_state


def _spec(x):
    # Every weight matrix split along its first dimension where that divides.
    n = jax.device_count()
    if x.ndim == 2 and x.shape[0] % n == 0:
        return jax.P("data")
    return jax.P()


def _arrays_by_path(state) -> dict:
    """What orbax used directly saves: the array leaves, keyed by key path."""
    return {
        jtu.keystr(p): x
        for p, x in jtu.tree_flatten_with_path(state)[0]
        if eqx.is_array(x)
    }


def _orbax_save(path, state):
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, _arrays_by_path(state))
        checkpointer.wait_until_finished()


def _orbax_restore(path, like):
    import orbax.checkpoint as ocp

    paths_leaves, treedef = jtu.tree_flatten_with_path(like)
    target = {
        jtu.keystr(p): jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        for p, x in paths_leaves
        if isinstance(x, jax.ShapeDtypeStruct)
    }
    with ocp.StandardCheckpointer() as checkpointer:
        arrays = checkpointer.restore(path, target)
    leaves = [
        arrays[jtu.keystr(p)] if isinstance(x, jax.ShapeDtypeStruct) else x
        for p, x in paths_leaves
    ]
    return jtu.tree_unflatten(treedef, leaves)


_COLD = """
import json, sys, time
import jax
jax.config.update("jax_num_cpu_devices", 8)
import equinox as eqx
import equinox_shard as eqxs
import jax.tree_util as jtu
from jax.sharding import NamedSharding
from benchmarks import checkpoint as c, _trees as t
variant, cfg, path = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
mesh = t.mesh()
put = lambda x: NamedSharding(mesh, c._spec(x))
like = jtu.tree_map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=put(x))
    if isinstance(x, jax.ShapeDtypeStruct) else x,
    eqx.filter_eval_shape(c._state, cfg),
)
start = time.perf_counter()
out = eqxs.restore(path, like) if variant == "eqxs" else c._orbax_restore(path, like)
jax.block_until_ready(eqx.filter(out, eqx.is_array))
print("SECONDS", time.perf_counter() - start)
"""


def _cold_restores(cfg: dict, state, root: pathlib.Path) -> dict:
    """The first restore in a fresh process, `eqxs` and `orbax`, `rounds` times."""
    paths = {"eqxs": root / "cold-eqxs", "orbax": root / "cold-orbax"}
    eqxs.save(paths["eqxs"], state)
    _orbax_save(paths["orbax"], state)
    keys = ("vocab", "length", "width", "heads", "depth")
    model_cfg = json.dumps({k: cfg[k] for k in keys})
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    root_dir = str(pathlib.Path(__file__).parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([root_dir, env.get("PYTHONPATH", "")])
    times: dict[str, list[float]] = {"eqxs": [], "orbax": []}
    for _ in range(cfg.get("cold_rounds", 3)):
        for variant, path in paths.items():
            result = subprocess.run(
                [sys.executable, "-c", _COLD, variant, model_cfg, str(path)],
                capture_output=True, text=True, env=env, cwd=root_dir, check=True,
            )  # fmt: skip
            line = [x for x in result.stdout.splitlines() if x.startswith("SECONDS")]
            times[variant].append(float(line[-1].split()[1]))
    return {
        "cold_restore_seconds": {v: statistics.median(times[v]) for v in times},
        "cold_restore_ratio_to_orbax": h.paired_ratios(times, list(times), "orbax"),
    }


def _with_saves(cfg: dict, state, root: pathlib.Path) -> dict:
    """Seconds of 10 donating training steps that start with a save of the state
    (background or blocking) or with none, per round, rounds interleaved."""
    optim = optax.adam(1e-3)

    @eqxs.filter_jit(donate="all")
    def train_step(model, opt_state, tokens, targets):
        loss, grads = eqx.filter_value_and_grad(_loss)(model, tokens, targets)
        updates, opt_state = optim.update(grads, opt_state)
        return eqx.apply_updates(model, updates), opt_state, loss

    batch = jax.NamedSharding(t.mesh(), jax.P("data"))
    batches = [jax.device_put(b, batch) for b in _batches(cfg, 10)]
    model, opt_state = jtu.tree_map(lambda x: x + 0 if eqx.is_array(x) else x, state)
    times = {m: [] for m in MODES}
    manager = eqxs.CheckpointManager(root / "background")
    import orbax.checkpoint as ocp

    checkpointer = ocp.StandardCheckpointer()
    step, loss = 0, None
    for r in range(cfg["warmup"] + cfg["reps"]):
        shift = r % len(MODES)
        for mode in MODES[shift:] + MODES[:shift]:
            jax.block_until_ready((model, opt_state))
            start = time.perf_counter()
            if mode == "background":
                manager.save(step, (model, opt_state), force=True)
            elif mode == "orbax-background":
                arrays = _arrays_by_path((model, opt_state))
                checkpointer.save(root / f"orbax-{step}", arrays)
            elif mode == "blocking":
                eqxs.save(root / f"blocking-{step}", (model, opt_state))
            for tokens, targets in batches:
                model, opt_state, loss = train_step(model, opt_state, tokens, targets)
                step += 1
            jax.block_until_ready((model, opt_state, loss))
            if r >= cfg["warmup"]:
                times[mode].append(time.perf_counter() - start)
            manager.wait_until_finished()  # each round on its own
            checkpointer.wait_until_finished()
            for name in ("blocking", "orbax"):
                shutil.rmtree(root / f"{name}-{step - 10}", ignore_errors=True)
    manager.close()
    checkpointer.close()
    return times


def run(cfg: dict) -> dict:
    cfg = {**cfg, **cfg["step"], **cfg.get("checkpoint", {})}
    mesh = t.mesh()
    with jax.set_mesh(mesh):
        state = eqxs.filter_device_put(_state(cfg), _spec)
    like = jtu.tree_map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
            if eqx.is_array(x)
            else x
        ),
        state,
    )
    unsharded = jtu.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if eqx.is_array(x) else x,
        state,
    )
    arrays = [x for x in jtu.tree_leaves(state) if eqx.is_array(x)]
    n_params = sum(x.size for x in jtu.tree_leaves(eqx.filter(state[0], eqx.is_array)))
    total = sum(x.nbytes for x in arrays)
    per_device = collections.Counter()
    for x in arrays:
        for s in x.addressable_shards:
            per_device[s.device.id] += s.data.nbytes
    share = max(per_device.values())
    root = pathlib.Path(tempfile.mkdtemp(prefix="eqxs-checkpoint-bench-"))

    def save(variant, path):
        if variant == "manager":
            with eqxs.CheckpointManager(path) as manager:
                manager.save(0, state)
        elif variant == "eqxs":
            eqxs.save(path, state)
        elif variant == "orbax":
            _orbax_save(path, state)
        else:
            eqx.tree_serialise_leaves(path, state)

    def restore(variant, path):
        if variant == "manager":
            with eqxs.CheckpointManager(path) as manager:
                return manager.restore(like)
        if variant == "eqxs":
            return eqxs.restore(path, like)
        if variant == "orbax":
            return _orbax_restore(path, like)
        loaded = eqx.tree_deserialise_leaves(path, unsharded)
        with jax.set_mesh(mesh):
            return eqxs.filter_device_put(loaded, _spec)

    save_times = {v: [] for v in VARIANTS}
    restore_times = {v: [] for v in VARIANTS}
    peaks = {v: 0 for v in VARIANTS}
    equal = {}
    try:
        for r in range(cfg["warmup"] + cfg["reps"] + 1):
            shift = r % len(VARIANTS)
            for v in VARIANTS[shift:] + VARIANTS[:shift]:
                path = root / (f"{v}-{r}" + (".eqx" if v == "eqx" else ""))
                start = time.perf_counter()
                save(v, path)
                saved = time.perf_counter()
                if r == cfg["warmup"] + cfg["reps"]:
                    # A last round, not timed: the peak memory, with the sampler.
                    out, peaks[v] = _peak_during(lambda: restore(v, path))
                    equal[v] = bool(
                        eqx.tree_equal(
                            eqx.filter(out, eqx.is_array),
                            eqx.filter(state, eqx.is_array),
                        )
                    ) and all(
                        a.sharding == b.sharding
                        for a, b in zip(
                            [x for x in jtu.tree_leaves(out) if eqx.is_array(x)],
                            arrays,
                        )
                    )
                else:
                    out = restore(v, path)
                    jax.block_until_ready(out)
                restored = time.perf_counter()
                del out
                if cfg["warmup"] <= r < cfg["warmup"] + cfg["reps"]:
                    save_times[v].append(saved - start)
                    restore_times[v].append(restored - saved)
                shutil.rmtree(path) if path.is_dir() else path.unlink()
            if cfg["verbose"]:
                print(f"  checkpoint round {r + 1}", flush=True)
        steps = _with_saves(cfg, state, root)
        cold = _cold_restores(cfg, state, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {
        "steps_seconds": {m: statistics.median(steps[m]) for m in MODES},
        "steps_ratio_to_none": h.paired_ratios(steps, list(MODES), "none"),
        "variants": list(VARIANTS),
        "n_params": n_params,
        "n_arrays": len(arrays),
        "state_bytes": total,
        "per_device_share_bytes": share,
        "devices": jax.device_count(),
        "save_seconds": {v: statistics.median(save_times[v]) for v in VARIANTS},
        "restore_seconds": {v: statistics.median(restore_times[v]) for v in VARIANTS},
        "save_ratio_to_orbax": h.paired_ratios(save_times, list(VARIANTS), "orbax"),
        "restore_ratio_to_orbax": h.paired_ratios(
            restore_times, list(VARIANTS), "orbax"
        ),
        "restore_peak_device_bytes": peaks,
        **cold,
        "restored_equal": equal,
    }


def render(result: dict) -> str:
    mib = lambda n: f"{n / 2**20:.1f}"
    headers = [
        "variant",
        "save ms",
        "save / orbax",
        "restore ms",
        "restore / orbax",
        "restore: peak MiB on one device",
        "bit-identical, same shardings",
    ]
    rows = [
        [
            v,
            f"{result['save_seconds'][v] * 1e3:.0f}",
            h.fmt(result["save_ratio_to_orbax"][v], "x"),
            f"{result['restore_seconds'][v] * 1e3:.0f}",
            h.fmt(result["restore_ratio_to_orbax"][v], "x"),
            mib(result["restore_peak_device_bytes"][v]),
            "yes" if result["restored_equal"].get(v) else "NO",
        ]
        for v in VARIANTS
    ]
    title = (
        f"### Checkpoints: a {result['n_params'] / 1e6:.2f}M-parameter transformer "
        f"with its Adam state ({mib(result['state_bytes'])} MiB), fully sharded over "
        f"{result['devices']} devices ({mib(result['per_device_share_bytes'])} MiB "
        "per device)"
    )
    gbs = lambda v: f"{result['state_bytes'] / result['restore_seconds'][v] / 1e9:.2f}"
    headers.insert(4, "restore GB/s")
    for row, v in zip(rows, VARIANTS):
        row.insert(4, gbs(v))
    steps = h.table(
        ["10 training steps", "ms", "/ no save"],
        [
            [
                {"none": "no save", "background": "a background save (manager)",
                 "orbax-background": "orbax's background save (StandardCheckpointer)",
                 "blocking": "a blocking save (eqxs.save)"}[m],
                f"{result['steps_seconds'][m] * 1e3:.0f}",
                h.fmt(result["steps_ratio_to_none"][m], "x"),
            ]
            for m in MODES
        ],
    )  # fmt: skip
    cold = h.table(
        ["first restore in a fresh process", "ms", "/ orbax"],
        [
            [v, f"{result['cold_restore_seconds'][v] * 1e3:.0f}",
             h.fmt(result["cold_restore_ratio_to_orbax"][v], "x")]
            for v in ("eqxs", "orbax")
        ],
    )  # fmt: skip
    return title + "\n\n" + h.table(headers, rows) + "\n\n" + steps + "\n\n" + cold
