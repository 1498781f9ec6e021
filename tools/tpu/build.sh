#!/usr/bin/env bash
# Builds here, into the ignored folder .whl-tpu/, every wheel that a TPU host with no
# network needs beyond its own JAX and package index: the project's own wheel
# (`equinox_shard` reads its version from its installed metadata) and pure-Python
# py3.11 wheels of Equinox, rich and the test-only packages, one version each,
# without their dependencies. Then `tools/tpu/run.sh` there (see its header).
#
#     bash tools/tpu/build.sh            # from the repository root, with network
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
OUT=.whl-tpu

# One version each: those that pip resolves for Python 3.11 with the oldest supported
# JAX (0.10.2), as on the chip's host (Python 3.11, x86_64). All pure Python but
# hypothesis, whose wheel for CPython 3.11 on manylinux x86_64 is taken.
WHEELS=(
  equinox==0.13.8 jaxtyping==0.3.11 wadler-lindig==0.1.8 typing-extensions==4.16.0
  rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 pygments==2.21.0
  pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 packaging==26.4
  hypothesis==6.170.27 sortedcontainers==2.4.0
  pytest-benchmark==5.3.1 py-cpuinfo2==10.1.1
  beartype==0.23.1 diffrax==0.7.2 lineax==0.1.1 optimistix==0.1.0
  optax==0.2.8 absl-py==2.5.1
)

rm -rf "$OUT"
mkdir -p "$OUT"
# (pip's notes on local index folders that lack a package are left out.)
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
  --implementation cp --platform manylinux_2_17_x86_64 -d "$OUT" "${WHEELS[@]}" \
  2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
"$PYTHON" -m pip wheel -q --no-deps . -w "$OUT"
# A wheel for another Python or platform would fail there: say so now.
if ls "$OUT"/*.whl | grep -v -E -- '-none-any\.whl$|-cp311-cp311-manylinux[^/]*x86_64\.whl$'; then
  echo "build.sh: the wheels above are not for CPython 3.11 on x86_64" >&2
  exit 1
fi
ls "$OUT"
du -sh "$OUT"
git check-ignore -q "$OUT" || echo "build.sh: warning: $OUT is not ignored by git" >&2
