"""Counts that do not vary from run to run, pinned so that a slower hot path fails a
test rather than hiding in a noisy timing (the timings are `python -m benchmarks`'s):
the Python calls and bytecodes of one warm call (`tools/hot_path.py --boundary`: JAX's
own Python counted at its boundary only, as its caches make the work within it vary
with what ran before), and the arrays that the call hands to `jax.device_put`, its
device copies. The cases are `tools/hot_path.py`'s: `filter_jit` plain, donating,
with `in_shardings` (inputs placed, uncommitted, and a NumPy batch) and with a
callback in its body, and `filter_device_put` of ten
arrays by layout (replicated, split) and source (uncommitted, placed).

Each pin is the count measured when it was set, per Python and JAX version (bytecodes
differ between them); a change that lowers a count lowers its pin."""

import sys

import jax
import jax.tree_util as jtu
import pytest
from tools import hot_path


_major, _minor = map(int, jax.__version__.split(".")[:2])
_VERSION = (sys.version_info[:2], (_major, _minor))

# (Python calls, bytecodes) per case.
_WORK = {
    ((3, 11), (0, 10)): {
        "plain": (18, 958),
        "donating": (41, 1529),
        "in_shardings": (36, 1084),
        "in_shardings uncommitted": (41, 1173),
        "in_shardings numpy": (43, 1207),
        "callback": (30, 1108),
        "filter_device_put replicated uncommitted": (121, 2521),
        "filter_device_put replicated placed": (40, 908),
        "filter_device_put split uncommitted": (44, 1377),
        "filter_device_put split placed": (40, 908),
    },
    ((3, 13), (0, 12)): {
        "plain": (14, 615),
        "donating": (35, 1137),
        "in_shardings": (32, 729),
        "in_shardings uncommitted": (37, 810),
        "in_shardings numpy": (39, 840),
        "callback": (26, 760),
        "filter_device_put replicated uncommitted": (116, 2377),
        "filter_device_put replicated placed": (39, 879),
        "filter_device_put split uncommitted": (42, 1310),
        "filter_device_put split placed": (39, 879),
    },
}

# (`jax.device_put` calls, arrays put) per case, on every version. Replicated from
# uncommitted arrays: a private copy of each on its own device first, as
# `jax.device_put(..., may_alias=False)` shares the source's buffer with the result
# on the source's device (upstream/jax-reports/device-put-may-alias-replicated).
_COPIES = {
    "plain": (0, 0),
    "donating": (0, 0),
    "in_shardings": (0, 0),
    # `jax.jit` moves uncommitted and NumPy inputs itself (issue 48).
    "in_shardings uncommitted": (0, 0),
    "in_shardings numpy": (0, 0),
    "callback": (0, 0),
    "filter_device_put replicated uncommitted": (2, 20),
    "filter_device_put replicated placed": (0, 0),
    "filter_device_put split uncommitted": (1, 10),
    "filter_device_put split placed": (0, 0),
}


@pytest.fixture(scope="module")
def cases():
    return {name: (fn, make_args) for name, fn, make_args in hot_path.cases()}


@pytest.mark.parametrize("name", list(_COPIES))
def test_python_work(cases, name):
    pinned = _WORK.get(_VERSION)
    if pinned is None:
        pytest.skip(f"no counts pinned for Python and JAX {_VERSION}")
    fn, make_args = cases[name]
    calls, bytecodes, per_file = hot_path.count(fn, make_args, jax_inside=False)
    want_calls, want_bytecodes = pinned[name]
    assert calls <= want_calls and bytecodes <= want_bytecodes, (
        f"{name}: {calls} Python calls and {bytecodes} bytecodes, pinned at "
        f"{want_calls} and {want_bytecodes}; calls per file: {per_file}"
    )


@pytest.mark.parametrize("name", list(_COPIES))
def test_device_copies(cases, name, monkeypatch):
    fn, make_args = cases[name]
    put = jax.device_put
    seen = []

    def counting(x, *args, **kwargs):
        seen.append(len(jtu.tree_leaves(x)))
        return put(x, *args, **kwargs)

    args = make_args()
    monkeypatch.setattr(jax, "device_put", counting)
    jax.block_until_ready(fn(*args))
    monkeypatch.undo()
    assert (len(seen), sum(seen)) == _COPIES[name], (
        f"{name}: {len(seen)} calls of `jax.device_put` putting {seen} arrays, pinned "
        f"at {_COPIES[name]}"
    )
