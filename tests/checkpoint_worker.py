"""Fresh processes for tests/test_checkpoint.py.

    python tests/checkpoint_worker.py clean DIR
    python tests/checkpoint_worker.py killed DIR
    python tests/checkpoint_worker.py train DIR LAYOUT... (steps 0..30; saves at 15)
    python tests/checkpoint_worker.py resume DIR LAYOUT... (restores 15; steps 15..30)
    python tests/checkpoint_worker.py multiprocess DIR PROCESS_ID NUM COORDINATOR
    python tests/checkpoint_worker.py overwrite DIR PHASE
    python tests/checkpoint_worker.py manager-killed DIR
    python tests/checkpoint_worker.py manager-retention-killed DIR PHASE
    python tests/checkpoint_worker.py manager-multiprocess DIR PROCESS_ID NUM COORD
    python tests/checkpoint_worker.py manager-fails DIR CALL
    python tests/checkpoint_worker.py manager-writer DIR
    python tests/checkpoint_worker.py manager-exit DIR HOW
    python tests/checkpoint_worker.py manager-fork DIR HOW

`clean`: a save and a restore onto another layout, as a user would run them (the test
checks that nothing at all is printed on stderr). `killed`: a save that stops just
before orbax finalises it (the test kills the process there with SIGKILL). `train` and
`resume`: the transformer example, uninterrupted and resumed from a checkpoint in this
fresh process; each writes its final state as NumPy arrays. `multiprocess`: one of
several `jax.distributed` processes, saving and restoring their own shards.
`overwrite`: saves `overwrite_state("old")`, then overwrites it with
`overwrite_state("new")`, stopping at PHASE (the test kills the process there).
`manager-killed`: a `CheckpointManager` saves step 1, then step 2 in the background,
stopping just before orbax finalises step 2 (the test kills the process there).
`manager-retention-killed`: a `CheckpointManager` keeping the last 2 saves steps 1, 2
and 3, stopping while retention deletes step 1 once PHASE (`first`, `half`, all but the
`last`) of its files and directories are removed (the test kills the process there).
`manager-multiprocess`: one of several `jax.distributed` processes saving steps 0 and 3
with a `CheckpointManager` in the background, then restoring the latest onto another
layout and checking its own shards.
`manager-fails`: a `CheckpointManager` saves step 1, then step 3 in the background,
whose directory cannot be created (`os.mkdir` fails with EROFS, as on a read-only file
system); then CALL (`wait`: `wait_until_finished()` then `close()`; `close`: only
`close()`; `close-read-only`: only `close()`, and the lock file cannot be removed
either, as in a directory made read-only after the manager was created; `none`:
neither) prints the error raised, and the process exits (the test's
deadline catches a hang). `manager-writer`: a `CheckpointManager` on DIR prints
`LOCKED` (or the error refusing it) and waits for stdin to close.
`manager-exit`: a `CheckpointManager` starts a background save of `exit_state()` as
step 0 and the program ends at once, by HOW (`end`: the script's end; `exit`:
`sys.exit(3)`; `raise`: an uncaught exception; `interrupt`: an uncaught
KeyboardInterrupt), never closing the manager.
`manager-fork`: a `CheckpointManager` on DIR, then forked processes: HOW `pool`: a
`multiprocessing.Pool` (fork) whose workers use the manager (printed) and exit, then a
second manager on DIR (printed `REFUSED` or `ACCEPTED`); `live`: a forked child that
lives on,
`inherited`: a child process given the lock file's descriptor, as a program started
without Python's fork hooks would hold it (each prints `FORKED` and its pid, and sleeps:
the test kills this process).
"""

import json
import os
import pathlib
import sys
import time


STEPS = 30
CHECKPOINT = 15


def _setup(devices: int = 8):
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", devices)
    return jax


def reference_state():
    """An MLP (NumPy parameters drawn from a fixed seed: nothing to compile; its
    activation a function), a typed PRNG key, an int counter and a string."""
    import equinox as eqx
    import jax
    import numpy as np

    rng = np.random.default_rng(0)
    mlp = eqx.filter_eval_shape(eqx.nn.MLP, 64, 64, 128, 2, key=jax.random.key(0))
    mlp = jax.tree.map(
        lambda x: (
            rng.standard_normal(x.shape).astype(x.dtype)
            if isinstance(x, jax.ShapeDtypeStruct)
            else x
        ),
        mlp,
    )
    return {"model": mlp, "key": jax.random.key(1), "step": 3, "name": "run"}


def clean(directory: pathlib.Path) -> None:
    jax = _setup()
    import equinox as eqx
    import equinox_shard as eqxs
    import numpy as np
    from jax.sharding import PartitionSpec as P

    rules = eqxs.PathRules([(r"weight$", P("data"))], default=P())
    state = reference_state()
    fsdp = jax.make_mesh((8,), ("data",))
    with jax.set_mesh(fsdp):
        state = eqxs.filter_device_put(state, rules)
    eqxs.save(directory / "ckpt", state)
    two_d = jax.make_mesh((4, 2), ("data", "model"))
    like = eqx.filter_eval_shape(lambda: state)
    with jax.set_mesh(two_d):
        out = eqxs.restore(
            directory / "ckpt",
            like,
            eqxs.PathRules([(r"weight$", P("data", "model"))], default=P()),
        )
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(state)):
        if eqx.is_array(a) and not jax.numpy.issubdtype(a.dtype, jax.dtypes.prng_key):
            assert np.array_equal(np.asarray(a), np.asarray(b))
    print("clean: ok", flush=True)


def killed(directory: pathlib.Path) -> None:
    _setup()
    import equinox_shard as eqxs
    import orbax.checkpoint as ocp

    def finalize(self, path):
        # Everything is written into orbax's temporary directory; the rename to the
        # final path has not happened. The test kills us here.
        print("WRITTEN", flush=True)
        time.sleep(600)

    ocp.CompositeCheckpointHandler.finalize = finalize  # pyright: ignore
    eqxs.save(directory / "ckpt", reference_state())


def overwrite_state(which: str) -> dict:
    import jax.numpy as jnp

    value = {"old": 1.0, "new": 2.0, "next": 3.0}[which]
    return {"x": jnp.full((1024,), value), "n": int(value)}


def overwrite(directory: pathlib.Path, phase: str) -> None:
    _setup()
    import shutil

    import equinox_shard as eqxs
    import orbax.checkpoint as ocp

    eqxs.save(directory / "ckpt", overwrite_state("old"))

    def stop(*args, **kwargs):
        print("WRITTEN", flush=True)
        time.sleep(600)

    if phase == "finalize":  # the new one written, not finalised
        ocp.CompositeCheckpointHandler.finalize = stop  # pyright: ignore
    elif phase == "renamed":  # both renames done; the old one not yet removed
        rmtree = shutil.rmtree
        shutil.rmtree = lambda p, *a, **k: (
            stop() if ".eqxs-" in str(p) else rmtree(p, *a, **k)
        )
    elif phase == "between":  # between the two renames
        rename = os.rename
        os.rename = lambda a, b: (
            stop() if str(a).endswith(".eqxs-overwrite") else rename(a, b)
        )
    eqxs.save(directory / "ckpt", overwrite_state("new"), overwrite=True)


def manager_killed(directory: pathlib.Path) -> None:
    _setup()
    import equinox_shard as eqxs
    import orbax.checkpoint as ocp

    manager = eqxs.CheckpointManager(directory)
    manager.save(1, overwrite_state("old"))
    manager.wait_until_finished()

    def finalize(self, path):
        print("WRITTEN", flush=True)
        time.sleep(600)

    ocp.CompositeCheckpointHandler.finalize = finalize  # pyright: ignore
    manager.save(2, overwrite_state("new"))
    manager.wait_until_finished()


def retention_state(step: int) -> dict:
    import jax.numpy as jnp

    return {"x": jnp.full((4096,), float(step)), "n": step}


def manager_retention_killed(directory: pathlib.Path, phase: str) -> None:
    _setup()
    import equinox_shard as eqxs
    from orbax.checkpoint._src.path import deleter

    manager = eqxs.CheckpointManager(directory, keep_last=2)
    for step in (1, 2):
        manager.save(step, retention_state(step))
        manager.wait_until_finished()
    # Step 3 makes retention delete step 1: stop after `phase` of its files and
    # directories are removed (the test kills us there).
    files = [p for p in (directory / "1").rglob("*")]
    stops = {"first": 1, "half": len(files) // 2, "last": len(files) - 1}
    stop_after = stops[phase] if phase in stops else int(phase)
    removed = []
    unlink, rmdir = os.unlink, os.rmdir
    delete = deleter.PathDeleter.delete

    def counted(original):
        def remove(*args, **kwargs):
            original(*args, **kwargs)
            removed.append(args[0])
            if len(removed) == stop_after:
                print("DELETING", flush=True)
                time.sleep(600)

        return remove

    def deleting(self, path, **kwargs):
        assert pathlib.Path(path).name == "1", path
        os.unlink, os.rmdir = counted(unlink), counted(rmdir)
        try:
            delete(self, path, **kwargs)
        finally:
            os.unlink, os.rmdir = unlink, rmdir

    deleter.PathDeleter.delete = deleting  # pyright: ignore
    manager.save(3, retention_state(3))
    manager.wait_until_finished()
    print("NOT KILLED", flush=True)


def _train(directory: pathlib.Path, layouts: list[str], resume: bool) -> None:
    jax = _setup()
    import equinox as eqx
    import equinox_shard as eqxs
    import numpy as np

    sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "examples"))
    import train_transformer as tt  # pyright: ignore[reportMissingImports]

    corpus = tt.load_corpus(200_000)
    cfg = tt.Config(steps=STEPS, depth=1)
    key = jax.random.key(cfg.seed)
    for name in layouts:
        layout = tt.make_layout(name, jax.devices())
        _, init_sharded, train_step = tt.make_functions(layout, cfg, {"train_step": 0})
        with jax.set_mesh(layout.mesh):
            if resume:
                like = init_sharded.eval_shape(key)
                model, opt_state = eqxs.restore(directory / name / "ckpt", like)
                # Where the rules put them, as a fresh initialisation would.
                fresh = init_sharded(key)
                restored = eqx.filter((model, opt_state), eqx.is_array)
                for a, b in zip(
                    jax.tree.leaves(restored),
                    jax.tree.leaves(eqx.filter(fresh, eqx.is_array)),
                    strict=True,
                ):
                    assert a.sharding == b.sharding, (a.sharding, b.sharding)
                first = CHECKPOINT
            else:
                model, opt_state = init_sharded(key)
                first = 0
            for step in range(first, STEPS):
                if step == CHECKPOINT and not resume:
                    eqxs.save(directory / name / "ckpt", (model, opt_state))
                batch = eqxs.filter_device_put(
                    tt.get_batch(corpus, cfg, step), layout.batch
                )
                model, opt_state, _ = train_step(model, opt_state, *batch)
        arrays = jax.tree.leaves(eqx.filter((model, opt_state), eqx.is_array))
        out = directory / name / ("resumed.npz" if resume else "uninterrupted.npz")
        np.savez(out, *[np.asarray(x) for x in arrays])
        print(f"{name}: done", flush=True)


def _distributed(process_id: int, num: int, coordinator):
    jax = _setup(4)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator,
        num_processes=num,
        process_id=process_id,
        initialization_timeout=300,
        heartbeat_timeout_seconds=30,
        shutdown_timeout_seconds=30,
    )
    return jax


def manager_multiprocess(directory, process_id: int, num: int, coordinator):
    jax = _distributed(process_id, num, coordinator)
    import equinox as eqx
    import equinox_shard as eqxs
    import numpy as np
    from jax.sharding import PartitionSpec as P

    reference = reference_state()
    rules = eqxs.PathRules([(r"weight$", P("data"))], default=P())
    with jax.set_mesh(jax.make_mesh((8,), ("data",))):
        state = eqxs.filter_device_put(reference, rules)
    with eqxs.CheckpointManager(directory, every_steps=3) as manager:
        for step in range(5):
            manager.save(step, state)
        manager.wait_until_finished()
        assert manager.all_steps() == [0, 3], manager.all_steps()
        two_d = jax.make_mesh((4, 2), ("data", "model"))
        like = eqx.filter_eval_shape(lambda: state)
        with jax.set_mesh(two_d):
            out = manager.restore(like, shardings=eqxs.PathRules(
                [(r"weight$", P("data", "model"))], default=P()))  # fmt: skip
    flat = jax.tree_util.tree_flatten_with_path
    for (path, x), (_, y) in zip(flat(out)[0], flat(reference)[0], strict=True):
        if not eqx.is_array(x):
            continue
        if jax.numpy.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        assert not x.is_fully_addressable
        for shard in x.addressable_shards:
            assert shard.device.process_index == process_id
            value = np.asarray(y)[shard.index]
            assert np.array_equal(np.asarray(shard.data), value), path
    jax.distributed.shutdown()
    print("manager-multiprocess: ok", flush=True)


def multiprocess(
    directory: pathlib.Path, process_id: int, num: int, coordinator, checksums: str
):
    jax = _distributed(process_id, num, coordinator)
    import equinox as eqx
    import equinox_shard as eqxs
    import numpy as np
    from equinox_shard._checkpoint import manifest
    from jax.sharding import PartitionSpec as P

    if checksums == "device":  # as on an accelerator: no shard read back to the host
        manifest.HOST_PLATFORMS = ()

        def on_the_host(*args):
            raise AssertionError("a checksum was computed on the host")

        manifest._partial_sum = on_the_host

    state = reference_state()
    rules = eqxs.PathRules([(r"weight$", P("data"))], default=P())
    mesh = jax.make_mesh((8,), ("data",))
    with jax.set_mesh(mesh):
        state = eqxs.filter_device_put(state, rules)
    for x in jax.tree.leaves(state):
        if eqx.is_array(x):
            assert not x.is_fully_addressable
    # Every process writes only its own shards (orbax splits the work).
    eqxs.save(directory / "ckpt", state)
    # Restore onto another layout of the same 8 devices, 4 in each process.
    two_d = jax.make_mesh((4, 2), ("data", "model"))
    like = eqx.filter_eval_shape(lambda: state)
    with jax.set_mesh(two_d):
        out = eqxs.restore(
            directory / "ckpt",
            like,
            eqxs.PathRules([(r"weight$", P("data", "model"))], default=P()),
        )
    lines = []
    for path, x in jax.tree_util.tree_flatten_with_path(out)[0]:
        if not eqx.is_array(x):
            continue
        if jax.numpy.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        assert x.sharding == jax.NamedSharding(two_d, x.sharding.spec)  # pyright: ignore
        for shard in x.addressable_shards:
            assert shard.device.process_index == process_id
            np.save(
                directory / f"p{process_id}_{len(lines)}.npy", np.asarray(shard.data)
            )
            index = [
                [s.start or 0, n if s.stop is None else s.stop]
                for s, n in zip(shard.index, x.shape)
            ]
            lines.append(
                json.dumps([jax.tree_util.keystr(path), shard.device.id, index])
            )
    (directory / f"p{process_id}.txt").write_text("\n".join(lines))
    jax.distributed.shutdown()
    print("multiprocess: ok", flush=True)


def manager_fails(directory: pathlib.Path, call: str) -> None:
    _setup()
    import errno

    import equinox_shard as eqxs
    import jax.numpy as jnp

    manager = eqxs.CheckpointManager(directory)
    manager.save(1, {"x": jnp.ones(64)})
    manager.wait_until_finished()
    mkdir = os.mkdir

    def read_only(path, *args, **kwargs):
        if "orbax-checkpoint-tmp" in os.fspath(path):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))
        return mkdir(path, *args, **kwargs)

    os.mkdir = read_only
    if call == "close-read-only":
        unlink = os.unlink

        def locked(path, *args, **kwargs):
            if os.fspath(path).endswith(".eqxs-writer"):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
            return unlink(path, *args, **kwargs)

        os.unlink = locked
    print("SAVE", manager.save(3, {"x": jnp.ones(64)}), flush=True)
    try:
        if call == "wait":
            try:
                manager.wait_until_finished()
            except Exception as e:
                print("WAIT", type(e).__name__, e, flush=True)
        if call != "none":
            manager.close()
    except Exception as e:
        print("CLOSE", type(e).__name__, e, flush=True)
    print("EXITING", flush=True)


def exit_state() -> dict:
    import jax.numpy as jnp

    return {"w": jnp.arange(1 << 20, dtype=jnp.float32), "step": 1000}


def manager_exit(directory: pathlib.Path, how: str) -> None:
    _setup()
    import equinox_shard as eqxs

    manager = eqxs.CheckpointManager(directory)
    print("SAVE", manager.save(0, exit_state()), flush=True)
    if how == "exit":
        sys.exit(3)
    elif how == "raise":
        raise ValueError("the training loop failed")
    elif how == "interrupt":
        raise KeyboardInterrupt


_MANAGER = None  # the manager of `manager-fork`, inherited by its forked workers


def _touch(_):
    try:
        _MANAGER.latest_step()  # pyright: ignore[reportOptionalMemberAccess]
        return "used"
    except RuntimeError as e:
        return "refused" if "inherited" in str(e) else str(e)


def manager_fork(directory: pathlib.Path, how: str) -> None:
    _setup()
    import multiprocessing
    import subprocess

    import equinox_shard as eqxs

    global _MANAGER
    manager = _MANAGER = eqxs.CheckpointManager(directory)
    if how == "pool":
        with multiprocessing.get_context("fork").Pool(2) as pool:
            print("POOL", pool.map(_touch, range(4), chunksize=1), flush=True)
            pool.close()
            pool.join()
        try:
            eqxs.CheckpointManager(directory)
            print("ACCEPTED", flush=True)
        except RuntimeError as e:
            print("REFUSED", e, flush=True)
        manager.close()
        return
    if how == "live":
        child = multiprocessing.get_context("fork").Process(
            target=time.sleep, args=(600,)
        )
        child.start()
        pid = child.pid
    else:  # "inherited": the descriptor passed on as no fork hook sees it
        lock = manager._lock  # pyright: ignore[reportAttributeAccessIssue]
        assert lock is not None
        pid = subprocess.Popen(["sleep", "600"], pass_fds=[lock]).pid
    print("FORKED", pid, flush=True)
    time.sleep(600)


def manager_writer(directory: pathlib.Path) -> None:
    _setup()
    import equinox_shard as eqxs

    try:
        manager = eqxs.CheckpointManager(directory)
    except Exception as e:
        print("REFUSED", type(e).__name__, e, flush=True)
        return
    print("LOCKED", flush=True)
    sys.stdin.read()
    manager.close()


def main(argv: list[str]) -> None:
    mode, directory = argv[0], pathlib.Path(argv[1])
    if mode == "clean":
        clean(directory)
    elif mode == "killed":
        killed(directory)
    elif mode in ("train", "resume"):
        _train(directory, argv[2:], resume=mode == "resume")
    elif mode == "manager-multiprocess":
        manager_multiprocess(directory, int(argv[2]), int(argv[3]), argv[4])
    elif mode == "manager-killed":
        manager_killed(directory)
    elif mode == "manager-fails":
        manager_fails(directory, argv[2])
    elif mode == "manager-exit":
        manager_exit(directory, argv[2])
    elif mode == "manager-fork":
        manager_fork(directory, argv[2])
    elif mode == "manager-writer":
        manager_writer(directory)
    elif mode == "manager-retention-killed":
        manager_retention_killed(directory, argv[2])
    elif mode == "overwrite":
        overwrite(directory, argv[2])
    elif mode == "multiprocess":
        multiprocess(directory, int(argv[2]), int(argv[3]), argv[4], argv[5])
    else:
        raise ValueError(mode)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main(sys.argv[1:])
