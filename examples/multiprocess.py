"""examples/train_digits.py across several JAX processes: JAX's multi-controller
runtime (`jax.distributed`), one process per host, each driving its own devices, all of
them together forming one global mesh.

On one machine: this launches 2 processes talking over 127.0.0.1, each simulating 4 CPU
devices (a global mesh of 8), trains, and checks the losses against a single-device
run (in process 0):

    python examples/multiprocess.py

Across machines: start one process per machine yourself, all with the address of
process 0 (any free port), each with its own `--process-id`:

    python examples/multiprocess.py --coordinator 10.0.0.1:1234 --num-processes 2 \\
        --process-id 0    # on 10.0.0.1
    python examples/multiprocess.py --coordinator 10.0.0.1:1234 --num-processes 2 \\
        --process-id 1    # on the other machine

(The same command with `--coordinator 127.0.0.1:1234`, in two terminals, is the
one-machine run without the launcher.) On CPUs, cross-process collectives go through
gloo; on GPUs and TPUs, through the accelerators' own.

What changes from one process: the model and the optimiser state are the same on every
process, so `filter_device_put` places them onto the global mesh as before (each process
gives the whole value; in a multi-process run they must be identical). The batches are
not: each process gives only its own rows of every batch, and
`filter_make_array_from_process_local_data` assembles the global batch. The training
step itself (`filter_jit` with `in_shardings`/`out_shardings`) is unchanged. Here every
process reads the (small) dataset and takes its rows; a real input pipeline would read
only its own shard.

It prints only its own progress and checks. The runtime's own logging (gloo's
connection messages, the distributed service's and XLA's logs) goes to a temporary file
that is shown only if a process fails; `--verbose` shows it as it comes.

Run `python examples/multiprocess.py --help` for the options.
"""

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],  # pyright: ignore[reportOptionalMemberAccess]
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--num-processes", type=int, default=2)
    parser.add_argument(
        "--process-id",
        type=int,
        default=None,
        help="this process's index; without it, launch --num-processes processes on "
        "this machine",
    )
    parser.add_argument(
        "--coordinator",
        default=None,
        help="HOST:PORT of process 0 (default with the launcher: 127.0.0.1 and a free "
        "port)",
    )
    parser.add_argument(
        "--devices-per-process",
        type=int,
        default=4,
        help="CPU devices to simulate in each process (CPU only)",
    )
    parser.add_argument("--layout", choices=("data", "fsdp", "tensor"), default="data")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--width", type=int, default=128, help="hidden layer width")
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--min-accuracy",
        type=float,
        default=None,
        help="held-out accuracy to reach (default: train_digits.MIN_ACCURACY)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=600,
        help="seconds; the launcher stops every process after this, and each process "
        "gives up joining the others after it",
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="show the runtime's own logging (gloo, the distributed service, XLA)",
    )
    return parser.parse_args(argv)


#
# The launcher: one machine, several processes.
#


def launch(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Starts `--num-processes` copies of this script with `--process-id`s, waits for
    them with a deadline, and stops them all as soon as one fails (its peers would
    otherwise wait for it in a collective until they time out)."""
    if args.coordinator is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            args.coordinator = f"127.0.0.1:{s.getsockname()[1]}"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                os.path.abspath(__file__),
                *argv,
                "--process-id",
                str(p),
                "--coordinator",
                args.coordinator,
            ]
        )
        for p in range(args.num_processes)
    ]
    deadline = time.monotonic() + args.timeout
    try:
        while any(proc.poll() is None for proc in procs):
            if any(proc.poll() not in (None, 0) for proc in procs):
                print("A process failed; stopping the others.", file=sys.stderr)
                break  # Its peers would wait for it in a collective.
            if time.monotonic() > deadline:
                print(f"Timed out after {args.timeout} s.", file=sys.stderr)
                break
            time.sleep(0.1)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    codes = [proc.returncode for proc in procs]
    return 0 if codes == [0] * len(codes) else 1


#
# One process.
#


def local_rows(sharding, rows: int):
    """The rows of a `(rows, ...)` array sharded by `sharding` along its first axis that
    this process holds, in the order in which
    `filter_make_array_from_process_local_data` expects them: the slices of this
    process's devices, in order (contiguous for the usual meshes)."""
    import numpy as np

    index = sharding.addressable_devices_indices_map((rows,)).values()
    starts = sorted({i[0].start or 0 for i in index})
    size = sharding.shard_shape((rows,))[0]
    return np.concatenate([np.arange(start, start + size) for start in starts])


@contextlib.contextmanager
def quiet_runtime(verbose: bool) -> Iterator[None]:
    """Sends everything written to file descriptors 1 and 2 (gloo and XLA write there
    from C++, and Python's logging and warnings through `sys.stderr`) to a temporary
    file, whilst `print` still reaches the terminal. If the body raises, the file is
    shown on the terminal's stderr, before the traceback."""
    if verbose:
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    terminal = os.fdopen(os.dup(1), "w", buffering=1)
    terminal_err = os.fdopen(os.dup(2), "w", buffering=1)
    saved_stdout = sys.stdout
    with tempfile.TemporaryFile("w+") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        sys.stdout = terminal
        try:
            yield
        except BaseException:
            sys.stderr.flush()
            log.seek(0)
            terminal_err.write(log.read())
            raise  # Its traceback follows, once the descriptors are restored.
        finally:
            sys.stdout = saved_stdout
            os.dup2(terminal.fileno(), 1)
            os.dup2(terminal_err.fileno(), 2)


def run(args: argparse.Namespace) -> int:
    with quiet_runtime(args.verbose):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    import jax

    if args.coordinator is None:
        raise SystemExit("--process-id needs --coordinator HOST:PORT.")
    # Before JAX starts its CPU backend; ignored on GPU/TPU.
    jax.config.update("jax_num_cpu_devices", args.devices_per_process)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        args.coordinator,
        num_processes=args.num_processes,
        process_id=args.process_id,
        initialization_timeout=int(args.timeout),
    )

    import equinox as eqx
    import equinox_shard as eqxs
    import numpy as np
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import train_digits as td

    me = jax.process_index()

    def say(text: str) -> None:
        if me == 0:
            print(text, flush=True)

    devices = jax.devices()  # every process's devices: the global mesh
    say(
        f"{jax.process_count()} processes x {jax.local_device_count()} "
        f"{devices[0].platform.upper()} devices = {len(devices)} devices"
    )
    data = td.load_data(args.seed)
    x_train, y_train, x_test, y_test = data
    layout = td.make_layout(args.layout, devices, td.make_model(args.seed, args.width))
    assert layout.mesh is not None
    n_data = layout.mesh.shape["data"]
    batch_size = -(-args.batch_size // n_data) * n_data
    batch = NamedSharding(layout.mesh, P("data"))  # what `layout.batch` resolves to
    rows = local_rows(batch, batch_size)
    say(f"layout {args.layout}: {layout.mesh}")
    say(f"batch size {batch_size}; process 0 gives rows {rows[0]}..{rows[-1]}")

    optim = optax.adam(args.learning_rate)
    model = td.make_model(args.seed, args.width)  # the same on every process
    params = eqx.filter(model, eqx.is_inexact_array)
    opt_state = optim.init(params)
    opt_spec = td.opt_state_spec(optim, opt_state, params, layout)
    traces = {"train_step": 0, "num_correct": 0}
    train_step, num_correct = td.make_functions(layout, optim, opt_spec, traces)

    start = time.perf_counter()
    losses = []
    with jax.set_mesh(layout.mesh), jax.numpy_dtype_promotion("standard"):
        # The same value on every process: filter_device_put, as in one process.
        model, opt_state = eqxs.filter_device_put(
            (model, opt_state), (layout.params, opt_spec)
        )
        for epoch in range(args.epochs):
            epoch_losses = []
            for x, y in td.batches(
                x_train, y_train, batch_size, seed=args.seed, epoch=epoch
            ):
                # Each process gives its own rows; together, the global batch.
                x, y = eqxs.filter_make_array_from_process_local_data(
                    layout.batch, (x[rows], y[rows])
                )
                model, opt_state, loss = train_step(model, opt_state, x, y)
                epoch_losses.append(loss)
            epoch_losses = [float(loss) for loss in epoch_losses]
            losses.extend(epoch_losses)
            say(
                f"epoch {epoch + 1:3d}/{args.epochs}  loss {np.mean(epoch_losses):.4f}"
                f"  ({time.perf_counter() - start:.1f} s)"
            )
        n_test = len(y_test)
        x_test = td.pad_to_multiple(x_test, n_data, 0.0)
        y_test = td.pad_to_multiple(y_test, n_data, -1)
        test_rows = local_rows(batch, len(y_test))
        x_test, y_test = eqxs.filter_make_array_from_process_local_data(
            layout.batch, (x_test[test_rows], y_test[test_rows])
        )
        accuracy = int(num_correct(model, x_test, y_test)) / n_test

    failures = []
    min_accuracy = td.MIN_ACCURACY if args.min_accuracy is None else args.min_accuracy
    if me == 0:
        # The unsharded reference, on one of this process's devices.
        with jax.numpy_dtype_promotion("standard"):
            reference = td.train(
                td.make_layout("single", jax.local_devices()[:1]),
                data,
                seed=args.seed,
                epochs=args.epochs,
                batch_size=batch_size,
                width=args.width,
                learning_rate=args.learning_rate,
            )
        error = float(np.max(np.abs(np.asarray(losses) - reference.losses)))
        checks = {
            f"per-step losses match the single-device run: max |diff| {error:.1e}": (
                td.losses_match(np.asarray(losses), reference.losses)
            ),
            f"test accuracy {accuracy:.4f} >= {min_accuracy}": (
                accuracy >= min_accuracy
            ),
            f"compiled once: {traces}": traces == {"train_step": 1, "num_correct": 1},
        }
        for text, ok in checks.items():
            say(("ok   " if ok else "FAIL ") + text)
            if not ok:
                failures.append(text)
    jax.distributed.shutdown()
    return 1 if failures else 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.process_id is None:
        return launch(args, argv)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
