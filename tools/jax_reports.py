"""Runs every reproduction in upstream/jax-reports/*/repro.py, each in a fresh process
with a deadline, and prints its outcome (exit status, killed by which signal, or timed
out) and its output's last lines: the evidence each report.md records.

    python tools/jax_reports.py                 # with this interpreter's JAX
    python tools/jax_reports.py --only NAME ... # some of them
"""

import argparse
import os
import pathlib
import signal
import subprocess
import sys


ROOT = pathlib.Path(__file__).resolve().parent.parent / "upstream" / "jax-reports"


def _outcome(returncode: int | None) -> str:
    if returncode is None:
        return "timed out (killed)"
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exit {returncode}"


def run(path: pathlib.Path, timeout: float) -> tuple[str, str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.Popen(
        [sys.executable, str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
        returncode = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        returncode = None
    # Our own prints only: XLA's log lines and stack dumps are long.
    lines = [
        line
        for line in output.splitlines()
        if line and not line.startswith(("E1", "F1", "W1", "I1", "    @", "***"))
    ]
    return _outcome(returncode), "\n".join(lines[-6:])


def main():
    parser = argparse.ArgumentParser(description="Runs the JAX bug reproductions.")
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--timeout", type=float, default=120)
    args = parser.parse_args()
    for path in sorted(ROOT.glob("*/repro.py")):
        name = path.parent.name
        if args.only and name not in args.only:
            continue
        outcome, tail = run(path, args.timeout)
        print(f"== {name}: {outcome}")
        for line in tail.splitlines():
            print(f"   {line}")


if __name__ == "__main__":
    main()
