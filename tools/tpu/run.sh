#!/usr/bin/env bash
# Runs on an accelerator host (a TPU v5e: Python 3.11, its own JAX and libtpu, its own
# package index, no network), from the repository root, with .whl-tpu/ beside it
# (built elsewhere by `bash tools/tpu/build.sh`). Each mode fits one 10-minute command;
# results go to $OUT (default ./tpu-out).
#
#     bash tools/tpu/run.sh bench [--quick]  # python -m benchmarks --device
#     bash tools/tpu/run.sh tests [ARGS]     # README's tests on the chip's backend
#         (ARGS: pytest's, e.g. a half of the files: tests/test_[a-j]*.py)
#     bash tools/tpu/run.sh inputs           # issue 48's cells: inputs as users pass them
#     bash tools/tpu/run.sh setup            # the installs only
#
# The installs (tools/tpu/install.py) go to $EQXS_TPU_SITE (default /tmp/eqxs-tpu),
# kept for the next command on the same machine; its two folders are appended to
# PYTHONPATH, so that the host's JAX stays the one imported. One program at a time can
# hold the chip: the modes run one after another, never together.
set -uo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
ROOT=${EQXS_TPU_SITE:-/tmp/eqxs-tpu}
OUT=${OUT:-$PWD/tpu-out}
mkdir -p "$ROOT" "$OUT"

"$PYTHON" tools/tpu/install.py "$ROOT" || exit 1
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$ROOT/site:$ROOT/site2"
"$PYTHON" - <<'PY' | tee "$OUT/versions.txt"
import importlib.metadata as md, platform, sys
print("python", platform.python_version(), sys.executable)
for name in ("jax", "jaxlib", "libtpu", "equinox", "equinox_shard", "orbax-checkpoint",
             "optax", "numpy", "pytest", "hypothesis", "tensorstore", "scikit-learn"):
    try:
        print(name, md.version(name), md.distribution(name).locate_file(""))
    except md.PackageNotFoundError:
        print(name, "-")
PY

mode=${1:-}
shift || true
case "$mode" in
  setup) ;;
  bench)
    # Stops itself before the command's 10 minutes: what ran is kept.
    timeout --signal=INT 570 "$PYTHON" -m benchmarks --device "$@" \
      --json "$OUT/device.json" > >(tee "$OUT/device.md") 2> >(tee "$OUT/device.err" >&2)
    status=$?
    echo "bench: exit status $status" | tee -a "$OUT/device.md"
    exit $status
    ;;
  inputs)
    # Dispatch of uncommitted, NumPy and committed inputs, and the training step fed a
    # fresh batch, on the chip (benchmarks/dispatch.py, benchmarks/step.py).
    timeout --signal=INT 280 "$PYTHON" -m benchmarks.dispatch --device "$@" \
      2>&1 | tee "$OUT/inputs.md"
    timeout --signal=INT 280 "$PYTHON" -m benchmarks.step --device 2>&1 | tee "$OUT/feeds.md"
    ;;
  tests)
    # README's test command on the chip's own backend (tests/conftest.py honours
    # JAX_PLATFORMS). SIGINT before the command's limit: pytest then still writes its
    # summary and junit file; every result line is in tests.log as it comes.
    JAX_PLATFORMS=${JAX_PLATFORMS:-tpu,cpu} timeout --signal=INT 560 \
      "$PYTHON" -m pytest -m "not slow" -p no:cacheprovider -rfEs -v --durations=20 \
      --junitxml="$OUT/junit.xml" "$@" > "$OUT/tests.log" 2>&1
    status=$?
    {
      echo "tests: exit status $status"
      tail -n 1 "$OUT/tests.log"
      echo
      echo "failed and errors:"
      grep -E '^(FAILED|ERROR) ' "$OUT/tests.log" || echo "(none)"
      echo
      echo "skip reasons (count, reason):"
      grep -E '^SKIPPED \[' "$OUT/tests.log" \
        | sed -E 's/^SKIPPED \[([0-9]+)\] [^ ]+ /\1 /' \
        | awk '{n=$1; $1=""; c[$0]+=n} END {for (r in c) print c[r], r}' | sort -rn
    } | tee "$OUT/summary.txt"
    exit $status
    ;;
  *)
    echo "usage: bash tools/tpu/run.sh setup | bench [--quick] | inputs | tests [PYTEST ARGS]" >&2
    exit 2
    ;;
esac
