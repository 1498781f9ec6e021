#!/usr/bin/env bash
# Equinox's whole test suite on two patched trees (0001 applied to Equinox v0.13.8 and to
# Equinox main 9336d82; COMMITS.txt in each), on this host's own JAX, on its CPU, with no
# network. The test dependencies come from wheels/ (installed with --no-index --no-deps
# into a temporary folder appended to PYTHONPATH, after the tree, so the host's JAX and
# NumPy stay the ones imported); main imports only with numpy < 2.5 (jaxtyping 0.3.11),
# so for main, where the host's NumPy is 2.5 or newer, numpy-wheel/'s 2.4.6 goes first.
#
#     OUT=/some/folder bash .eqx-suite/run.sh [TREE...]   # TREE: v0.13.8, main (default both)
#
# Each tree: `python -m pytest -n ${N:-12} -q -p no:cacheprovider -rfE --tb=line tests` in
# the tree (TESTS overrides `tests`), under `timeout --signal=INT ${TIMEOUT:-280}` (pytest prints
# its summary); output in $OUT/suite_<tree>.txt (first lines: the commit and versions); one
# line per tree on stdout.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
PYTHON=${PYTHON:-python3}
OUT=${OUT:-$PWD/eqx-suite-out}
N=${N:-12}
SITE=$(mktemp -d)
mkdir -p "$OUT"
trap 'rm -rf "$SITE"' EXIT

PIP_CONFIG_FILE=/dev/null "$PYTHON" -m pip install -q --isolated --no-index --no-deps \
  --target "$SITE/site" "$HERE"/wheels/*.whl || { echo "run.sh: install failed"; exit 1; }
old_numpy=$("$PYTHON" -c 'import numpy as np; print(int(tuple(map(int, np.__version__.split(".")[:2])) < (2, 5)))')
if [ "$old_numpy" != 1 ]; then
  PIP_CONFIG_FILE=/dev/null "$PYTHON" -m pip install -q --isolated --no-index --no-deps \
    --target "$SITE/numpy" "$HERE"/numpy-wheel/*.whl || { echo "run.sh: numpy install failed"; exit 1; }
fi

for tree in "${@:-v0.13.8 main}"; do
  for t in $tree; do
    # Equinox reads its version from installed metadata: a minimal record of it.
    version=$(sed -n 's/^version = "\(.*\)"$/\1/p' "$HERE/$t/pyproject.toml")
    meta="$SITE/meta-$t/equinox-$version.dist-info"
    mkdir -p "$meta"
    printf 'Metadata-Version: 2.1\nName: equinox\nVersion: %s\n' "$version" > "$meta/METADATA"
    path="$SITE/meta-$t:$SITE/site"
    if [ "$t" = main ] && [ "$old_numpy" != 1 ]; then path="$SITE/numpy:$path"; fi
    file="$OUT/suite_$t.txt"
    (
      cd "$HERE/$t" || exit 1
      export JAX_PLATFORMS=cpu PYTHONPATH="$HERE/$t:$path${PYTHONPATH:+:$PYTHONPATH}"
      {
        head -n 1 COMMITS.txt
        "$PYTHON" -c 'import sys, jax, numpy, equinox, pytest; print("python", sys.version.split()[0], "jax", jax.__version__, "numpy", numpy.__version__, "pytest", pytest.__version__, "equinox from", equinox.__file__)'
        timeout --signal=INT "${TIMEOUT:-280}" "$PYTHON" -m pytest -n "$N" -q -p no:cacheprovider -p no:benchmark -W "ignore:Transparent hugepages:UserWarning" -W "ignore:cloud_tpu_init failed:UserWarning" \
          -rfE --tb=line ${TESTS:-tests}
        echo "exit status $?"
      } > "$file" 2>&1
    )
    echo "$t: $(grep -E '(passed|failed|error).* in [0-9.]+s' "$file" | tail -n 1) ($(tail -n 1 "$file"))"
  done
done
