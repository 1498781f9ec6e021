"""Counts that do not vary from run to run, as ceilings, so that a slower hot path fails
a test rather than hiding in a noisy timing (the timings are `python -m benchmarks`'s).
The cases are `tools/hot_path.py`'s: `filter_jit` plain, donating, with `in_shardings`
(inputs placed, uncommitted, and a NumPy batch; on a one-device mesh, donating, its
batch put on the device, and not donating, its inputs placed, uncommitted or both) and
a callback in its body, and `filter_device_put` of ten arrays by layout (replicated,
split) and source (uncommitted, placed). Per warm call (`tools/hot_path.py
--boundary`: JAX's own Python counted at its boundary only):

- its passes over the leaves through JAX's tree functions, its Python calls into
    `_jit/packing.py` (packing the arguments for `jax.jit`, which then flattens them
    in C++, and combining the output), and the arrays it hands to `jax.device_put`
    (its device copies): exact, as our code alone decides them;
- its Python calls and bytecodes: ceilings with headroom over the most measured on
    Python 3.11 with JAX 0.10.2 and Python 3.13 with JAX 0.12 (Equinox's Python and
    CPython's differ between them), so a refactor may add a frame but not a pass.

A change that lowers a count lowers its entry."""

import math
import sys

import jax
import jax.tree_util as jtu
import pytest
from tools import hot_path


# case: (Python calls, bytecodes, passes over the leaves through JAX's tree functions,
# Python calls into `_jit/packing.py`). The largest over the supported range: the
# oldest Equinox (0.13.1, CI's Python 3.11 step) runs more in `Module.__call__`.
_WORK = {
    # A warm call of the last entry (`filter_jit`'s step 0): no look-up, no `prepare`.
    "plain": (12, 964, 2, 1),
    "donating": (39, 1678, 3, 2),
    # On several CPU devices too: step 0 launches as `launch.paced_serialized` does.
    "in_shardings": (27, 1038, 2, 1),
    "in_shardings uncommitted": (22, 1058, 1, 1),
    "in_shardings numpy": (28, 1305, 1, 2),
    "one device, batch on it": (56, 1842, 3, 2),
    # Step 0 on a one-device mesh: inputs on their targets run the entry's `jax.jit`,
    # uncommitted ones `Typed`'s executable.
    "one device, placed": (26, 994, 2, 1),
    "one device, uncommitted": (20, 1003, 1, 1),
    "one device, placed model, fresh batch": (34, 1040, 1, 1),
    "callback": (26, 1232, 4, 2),
    "filter_device_put replicated uncommitted": (117, 2686, 2, 0),
    "filter_device_put replicated placed": (43, 966, 2, 0),
    "filter_device_put split uncommitted": (52, 1522, 2, 0),
    "filter_device_put split placed": (43, 966, 2, 0),
}

# (`jax.device_put` calls, arrays put) per case. Replicated from uncommitted arrays: a
# private copy of each on its own device first, as `jax.device_put(...,
# may_alias=False)` shares the source's buffer with the result on the source's device
# (upstream/jax-reports/device-put-may-alias-replicated).
_COPIES = {
    "plain": (0, 0),
    "donating": (0, 0),
    "in_shardings": (0, 0),
    # `jax.jit` moves uncommitted and NumPy inputs itself (issue 48).
    "in_shardings uncommitted": (0, 0),
    "in_shardings numpy": (0, 0),
    # An equivalent sharding is not moved (`jax.jit` takes it as it is).
    "one device, batch on it": (0, 0),
    "one device, placed": (0, 0),
    "one device, uncommitted": (0, 0),
    "one device, placed model, fresh batch": (0, 0),
    "callback": (0, 0),
    "filter_device_put replicated uncommitted": (2, 20),
    "filter_device_put replicated placed": (0, 0),
    "filter_device_put split uncommitted": (1, 10),
    "filter_device_put split placed": (0, 0),
}

# JAX's modules of tree functions: a call into one is a pass over a tree's leaves.
_TREE_FILES = ("tree_util.py", "tree.py")


def ceilings(calls: int, bytecodes: int) -> tuple[int, int]:
    """The most Python calls and bytecodes allowed for a case measured at most at
    `calls` and `bytecodes`: 15% more, and at least 3 more calls."""
    return max(calls + 3, math.ceil(calls * 1.15)), math.ceil(bytecodes * 1.15)


@pytest.fixture(scope="module")
def cases():
    return {name: (fn, make_args) for name, fn, make_args in hot_path.cases()}


@pytest.mark.parametrize("name", list(_WORK))
def test_python_work(cases, name):
    fn, make_args = cases[name]
    calls, bytecodes, per_file = hot_path.count(fn, make_args, jax_inside=False)
    most_calls, most_bytecodes, want_passes, want_packing = _WORK[name]
    passes = sum(per_file.get(f, 0) for f in _TREE_FILES)
    packing = per_file.get("packing.py", 0)
    max_calls, max_bytecodes = ceilings(most_calls, most_bytecodes)
    within = calls <= max_calls and bytecodes <= max_bytecodes
    assert passes == want_passes and packing == want_packing and within, (
        f"{name}: {passes} passes over the leaves (want {want_passes}), {packing} "
        f"calls into packing.py (want {want_packing}), {calls} Python calls (at most "
        f"{max_calls}) and {bytecodes} bytecodes (at most {max_bytecodes}); calls per "
        f"file: {per_file}"
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


# The audit events of the call being counted, else `None`: a hook cannot be removed, so
# `_recording` adds one once, idle outside this test.
_events: list | None = None


def _record(event: str, args) -> None:
    if _events is not None:
        _events.append(event)


@pytest.fixture(scope="module")
def _recording():
    sys.addaudithook(_record)


@pytest.mark.parametrize("name", list(_WORK))
def test_no_audit_events(cases, _recording, name):
    # Each event runs every audit hook, in Python: filelock's (imported by JAX on
    # Python >= 3.12) made `id` ~4x slower. `jax.jit`'s warm call raises none.
    global _events
    fn, make_args = cases[name]
    args = make_args()
    _events = []
    try:
        out = fn(*args)
    finally:
        events, _events = _events, None
    jax.block_until_ready(out)
    assert events == [], f"{name}: a warm call raised the audit events {events}"


# `jax.jit`'s positional arguments, one per argument slot: a sequence, not a step's
# values (issue 64 asks steps to hand back one value or a pair).
_ARGUMENT_LISTS = {"_jit/packing.py:Packing.arguments"}


@pytest.mark.parametrize("name", [n for n in _WORK if "filter_device_put" not in n])
def test_warm_call_passes_one_value(cases, name):
    # Issue 64: no function of ours on the warm call path takes more than 4 parameters
    # or hands back a bare tuple of more than 2 (the call is one record, `cache.Call`).
    fn, make_args = cases[name]
    ours = hot_path._OURS
    seen: dict[str, tuple[int, int]] = {}

    def profile(frame, event, arg):
        code = frame.f_code
        if not code.co_filename.startswith(ours):
            return
        where = f"{code.co_filename[len(ours) :]}:{code.co_qualname}"
        params, longest = seen.get(where, (0, 0))
        if event == "call":
            params = code.co_argcount + code.co_kwonlyargcount
        elif event == "return" and type(arg) is tuple:
            longest = max(longest, len(arg))
        seen[where] = (params, longest)

    args = make_args()
    sys.setprofile(profile)
    try:
        out = fn(*args)
    finally:
        sys.setprofile(None)
    jax.block_until_ready(out)
    assert "_jit/filter_jit.py:_JitWrapper.__call__" in seen, sorted(seen)
    wide = {k: v for k, v in seen.items() if v[0] > 4}
    bare = {k: v for k, v in seen.items() if v[1] > 2 and k not in _ARGUMENT_LISTS}
    assert not wide and not bare, (
        f"{name}: (parameters, longest tuple returned) of functions taking more than "
        f"4 parameters: {wide}; returning a bare tuple of more than 2: {bare}"
    )
