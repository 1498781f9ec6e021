"""Pipeline parallelism (`eqxs.filter_pipeline`, issue 40), on the transformer of
`examples/train_transformer.py` and 8 simulated devices:

- the example's `pipeline` layout (stage 4 x data 2) against its `data` and `fsdp`
    layouts, each trained from the same initialisation on the same batches: the
    losses, per-device parameter bytes (the largest over devices, read from the
    arrays' addressable shards), compile time (trace, lower and compile the training
    step) and step time (the median after the first step, waited for);
- the bubble of the schedule the code runs (`_manual.pipeline.schedule`), next to the
    formula (S - 1)/(R M + S - 1);
- the training step's temporary memory (XLA's compiled `memory_analysis()`) in the
    `pipeline` layout without and with `remat`.

Simulated CPU devices share the machine's cores: step times show the overhead of a
layout (its collectives, its bubble's wasted compute, recomputation), not the speed-up
of real devices working in parallel.
"""

import dataclasses
import statistics
import time

import equinox as eqx
import jax
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
from equinox_shard._manual.pipeline import schedule

from . import _harness as h


LAYOUTS = ("data", "fsdp", "pipeline")


def _bytes_per_device(tree) -> int:
    held: dict = {}
    for a in jtu.tree_leaves(eqx.filter(tree, eqx.is_array)):
        for shard in a.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return max(held.values())


def _layout_run(tt, name: str, cfg, corpus, verbose: bool) -> dict:
    devices = jax.devices()
    layout = tt.make_layout(name, devices)
    counts = {"train_step": 0}
    _, init_sharded, train_step = tt.make_functions(layout, cfg, counts)
    key = jr.key(cfg.seed)
    with jax.set_mesh(layout.mesh):
        model, opt_state = init_sharded(key)
        batch = tt.get_batch(corpus, cfg, 0)
        start = time.perf_counter()
        compiled = train_step.lower(model, opt_state, *batch).compile()
        compile_s = time.perf_counter() - start
        memory = compiled.compiled.memory_analysis()  # `jax.stages.Compiled`
        params = _bytes_per_device(model)
        total = sum(a.nbytes for a in jtu.tree_leaves(eqx.filter(model, eqx.is_array)))
        losses, times = [], []
        for step in range(cfg.steps):
            batch = tt.get_batch(corpus, cfg, step)
            start = time.perf_counter()
            model, opt_state, loss = train_step(model, opt_state, *batch)
            losses.append(float(loss))  # waits for the step
            times.append(time.perf_counter() - start)
    if verbose:
        print(f"  {name}: {compile_s:.1f} s to compile", flush=True)
    return {
        "losses": losses,
        "compile_s": compile_s,
        "step_s": statistics.median(times[1:]) if len(times) > 1 else times[0],
        "param_bytes_per_device": params,
        "param_bytes_total": total,
        "temp_bytes": None if memory is None else memory.temp_size_in_bytes,
        "traces": counts["train_step"],
    }


def _remat_memory(tt, cfg, remat: bool) -> int | None:
    layout = tt.make_layout("pipeline", jax.devices())
    cfg = dataclasses.replace(cfg, remat=remat)
    _, init_sharded, train_step = tt.make_functions(layout, cfg, {"train_step": 0})
    with jax.set_mesh(layout.mesh):
        like = init_sharded.eval_shape(jr.key(0))
        tokens = jax.ShapeDtypeStruct((cfg.batch, cfg.length), np.int32)
        compiled = train_step.lower(*like, tokens, tokens).compile()
        memory = compiled.compiled.memory_analysis()
    return None if memory is None else memory.temp_size_in_bytes


def _bubbles(stages_list) -> list[dict]:
    rows = []
    for stages in stages_list:
        for repeats in (1, 2):
            for microbatches in (stages, 2 * stages, 4 * stages):
                table = schedule(stages, microbatches, repeats)
                rows.append(
                    {
                        "stages": stages,
                        "microbatches": microbatches,
                        "repeats": repeats,
                        "ticks": table.shape[1],
                        "idle": float((table[..., 0] < 0).mean()),
                        "formula": (stages - 1) / (repeats * microbatches + stages - 1),
                    }
                )
    return rows


def run(cfg: dict) -> dict:
    tt = h.transformer_example()
    quick = cfg["reps"] <= 2
    model_cfg = tt.Config(steps=20)
    if quick:
        model_cfg = tt.Config(steps=2, length=16, width=16, heads=2, hidden=32)
    corpus = tt.load_corpus(200_000)
    layouts = {
        name: _layout_run(tt, name, model_cfg, corpus, cfg["verbose"])
        for name in LAYOUTS
    }
    data = np.asarray(layouts["data"]["losses"])
    for result in layouts.values():
        losses = np.asarray(result["losses"])
        result["max_relative_loss_difference_to_data"] = float(
            np.max(np.abs(losses / data - 1))
        )
    return {
        "devices": len(jax.devices()),
        "model": dataclasses.asdict(model_cfg),
        "layouts": layouts,
        "bubble": _bubbles((4, 8)),
        "remat_temp_bytes": {
            str(remat): _remat_memory(tt, model_cfg, remat) for remat in (False, True)
        },
    }


def render(result: dict) -> str:
    m = result["model"]
    rows = []
    for name, r in result["layouts"].items():
        temp = r["temp_bytes"]
        rows.append(
            [
                name,
                f"{r['losses'][-1]:.4f}",
                f"{r['max_relative_loss_difference_to_data']:.1e}",
                f"{r['param_bytes_per_device'] / 1024:.1f} of "
                f"{r['param_bytes_total'] / 1024:.1f}",
                f"{r['compile_s']:.2f}",
                f"{r['step_s'] * 1e3:.1f}",
                "-" if temp is None else f"{temp / 2**20:.2f}",
            ]
        )
    first = (
        f"### Pipeline: the transformer example ({m['depth']} layers, width "
        f"{m['width']}, batch {m['batch']}x{m['length']}, {m['steps']} steps, "
        f"{m['microbatches']} microbatches) on {result['devices']} devices\n\n"
        + h.table(
            [
                "layout",
                "final loss",
                "max rel. diff. to data",
                "param KiB per device",
                "compile s",
                "ms/step",
                "temp MiB",
            ],
            rows,
        )
    )
    bubble = "### Pipeline bubble: idle stage-ticks of the schedule run\n\n" + h.table(
        ["S", "M", "R", "ticks", "idle (measured)", "(S-1)/(RM+S-1)"],
        [
            [
                str(b["stages"]),
                str(b["microbatches"]),
                str(b["repeats"]),
                str(b["ticks"]),
                f"{b['idle']:.3f}",
                f"{b['formula']:.3f}",
            ]
            for b in result["bubble"]
        ],
    )
    remat = result["remat_temp_bytes"]
    memory = "### Pipeline: training step temporary memory (compiled)\n\n" + h.table(
        ["remat", "temp MiB"],
        [
            [k, "-" if v is None else f"{v / 2**20:.2f}"]
            for k, v in (("off", remat["False"]), ("on", remat["True"]))
        ],
    )
    return "\n\n".join([first, bubble, memory])
