"""Runs a check in a fresh Python process with 8 simulated CPU devices and a deadline.

For checks whose failure mode would take the test run down with it: a segmentation
fault inside XLA, or a deadlock. The snippet runs after a preamble that sets up the
devices (and the same configuration as tests/conftest.py); it reports back by printing
one line of JSON, prefixed with `RESULT `, which `run_isolated` returns parsed.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
from typing import Any


_PREAMBLE = """\
import json
import jax
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_num_cpu_devices", 8)

def report(value):
    print("RESULT " + json.dumps(value), flush=True)

"""


# A child's deadline only guards against a hang (a deadlock, or peers waiting for a dead
# process): far past any run, so that no test fails because the machine is busy.
HANG_SECONDS = 1200

# The tests check what a program computes and where it lives, not how fast it runs: on
# the CPU they compile without LLVM's optimizations, which is 2-4x quicker to compile.
CPU_COMPILE_FLAGS = (
    "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
)

# What a TPU v5e host's JAX prints at `import jax` in every process (a VM setting).
_RUNTIME_WARNING = "ignore:Transparent hugepages are not enabled:UserWarning"


def child_env() -> dict:
    """The environment of a child process: the tests' CPU devices (on an accelerator
    the parent holds the chip, which a child cannot open), without the runtime's
    warning at `import jax`, so that a child's stderr holds only what it says."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=CPU_COMPILE_FLAGS)
    warnings = [w for w in (env.get("PYTHONWARNINGS"), _RUNTIME_WARNING) if w]
    env["PYTHONWARNINGS"] = ",".join(warnings)
    return env


class Isolated:
    """What happened in the fresh process: `returncode` (negative: killed by that
    signal; `None`: it ran past its deadline and was killed), `result` (what the snippet
    passed to `report`, or `None`) and the tail of its output."""

    def __init__(self, returncode: int | None, result: Any, output: str):
        self.returncode = returncode
        self.result = result
        self.output = output

    def __repr__(self):
        return (
            f"Isolated(returncode={self.returncode}, result={self.result!r}, "
            f"output=...{self.output[-3000:]!r})"
        )


def run_isolated(code: str, *, timeout: float) -> Isolated:
    """Runs `code` (dedented) in a new process group; kills the group after `timeout`
    seconds, or `HANG_SECONDS` if that is longer."""
    timeout = max(timeout, HANG_SECONDS)
    env = child_env()
    proc = subprocess.Popen(
        [sys.executable, "-c", _PREAMBLE + textwrap.dedent(code)],
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
    result = None
    for line in output.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
    return Isolated(returncode, result, output)


def killed_after_first_line(*args: str) -> tuple[str, int | None]:
    """Runs `python *args` with the tests' CPU devices, reads the first line it prints,
    then kills it (SIGKILL): `(line, returncode)`. For saves killed midway."""
    env = child_env()
    with subprocess.Popen(
        [sys.executable, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    ) as proc:
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    return line, proc.returncode
