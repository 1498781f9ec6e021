"""Differential test: sequences of calls on one `filter_jit` wrapper, each compared with
an oracle after every call.

The oracle is `eqx.filter_jit` of the same function when there are no shardings, and
`jax.jit` of the same function on the partitioned leaves (`eqx.partition` by
`eqx.is_array`, `in_shardings`/`out_shardings` on the array part) when there are.

A state machine fixes, once per sequence, the function body (plain, or with
`eqx.error_if`, `jax.debug.callback` or `jax.pure_callback` in it), the placement (none,
replicated on 8 devices, or split over them) and the donation mode; then it draws calls:
shapes, dtypes (int32, float32, bool), weak types (`jnp.asarray` of a Python scalar),
static leaves (Python ints and strings), structures (tuples, dicts, an `eqx.Module`
with a static field), committed and uncommitted inputs, and calls from several threads.
After every call: the same values, dtypes, weak types, output structure and output
shardings; the same non-array objects; only donated inputs deleted, and at least those
the oracle deletes; inputs not deleted unchanged; and no more traces of the body than
the oracle's.

CI cost: the default run draws 4 sequences of at most 6 calls (24 calls, each of them
compared), the `slow` one 20; `-p tests.hypothesis_profiles --hypothesis-profile=long`
draws 1000.
"""

import threading
import warnings
from typing import Any

import equinox as eqx
import equinox_shard as eqxs
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from equinox_shard._jit import donation
from hypothesis import settings
from hypothesis.stateful import initialize, invariant, rule, RuleBasedStateMachine
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from .helpers import snapshot
from .hypothesis_profiles import examples
from .strategies import cached_mesh


_STEPS = 6
_BODIES = ("plain", "error_if", "debug_callback", "pure_callback")
_PLACEMENTS = ("none", "replicated", "split")
_DTYPES = (np.float32, np.int32, np.bool_)
_STATICS = (0, 3, "a", "bc")


def _donated_args(mode: str) -> tuple[int, ...]:
    """The arguments of a two-argument call that `mode` donates (`_jit.donation`)."""
    donates, _ = donation.MODES[mode]
    return tuple(p for p in (0, 1) if donates(p, 2))


# One mode per donation of the table's: the "warn" modes donate as their twins, and
# differ only in JAX's warning, which both sides would then show.
_FIRST_OF_EACH: dict[tuple[int, ...], str] = {}
for _mode in donation.MODES:
    _FIRST_OF_EACH.setdefault(_donated_args(_mode), _mode)
_DONATE = tuple(_FIRST_OF_EACH.values())


#
# Inputs: drawn as descriptions, materialised afresh for each side (independent copies).
#


class _Leaf(eqx.Module):
    """How to make one array leaf: `kind` is 'strong' (`jnp.asarray` of a NumPy array),
    'weak' (`jnp.asarray` of a Python scalar), 'numpy', 'placed' (committed), or
    'placed weak' (a weak one, committed)."""

    kind: str = eqx.field(static=True)
    shape: tuple = eqx.field(static=True)
    dtype: Any = eqx.field(static=True)
    seed: int = eqx.field(static=True)


class _Node(eqx.Module):
    first: Any
    rest: Any
    tag: str = eqx.field(static=True)


def _host(leaf: _Leaf) -> np.ndarray:
    rng = np.random.default_rng(leaf.seed)
    if leaf.dtype == np.bool_:
        return rng.random(leaf.shape) > 0.5
    if leaf.dtype == np.int32:
        return rng.integers(-50, 50, leaf.shape).astype(np.int32)
    return rng.standard_normal(leaf.shape).astype(np.float32)


def _materialise(desc, sharding):
    def make(leaf):
        if not isinstance(leaf, _Leaf):
            return leaf  # the same object on both sides
        host = _host(leaf)
        if leaf.kind == "numpy":
            return host
        value = jnp.asarray(host.item() if "weak" in leaf.kind else host)
        if leaf.kind.startswith("placed"):
            return jax.device_put(value, sharding or jax.devices()[0])
        return value

    return jtu.tree_map(make, desc, is_leaf=lambda x: isinstance(x, _Leaf))


@st.composite
def _leaves(draw, split: bool):
    if split:
        shape = draw(st.sampled_from([(8,), (16,), (8, 2)]))
        kind = draw(st.sampled_from(["strong", "strong", "numpy", "placed"]))
    else:
        shape = draw(st.sampled_from([(), (3,), (2, 3), (4,)]))
        weak = ["weak", "placed weak"] * (shape == ())
        kinds = ["strong", "strong", "numpy", "placed", *weak]
        kind = draw(st.sampled_from(kinds))
    dtype = draw(st.sampled_from(_DTYPES))
    return _Leaf(kind, shape, dtype, draw(st.integers(0, 3)))


@st.composite
def _trees(draw, split: bool, depth: int = 2):
    if depth == 0:
        return draw(_leaves(split))
    option = draw(st.sampled_from(["leaf", "leaf", "static", "node"]))
    if option == "leaf":
        return draw(_leaves(split))
    if option == "static":
        return draw(st.sampled_from(_STATICS))
    children = [draw(_trees(split, depth - 1)) for _ in range(draw(st.integers(1, 3)))]
    kind = draw(st.sampled_from(["tuple", "dict", "Module"]))
    if kind == "tuple":
        return tuple(children)
    if kind == "dict":
        return dict(zip("xyz", children))
    return _Node(children[0], tuple(children[1:]), draw(st.sampled_from(["p", "q"])))


#
# The function under test, and its oracle.
#


def _host_identity(x):
    return np.asarray(x)


def _noop(x):
    del x


def _make_body(body: str, counts: dict, side: str):
    def fn(first, rest):
        counts[side] += 1

        def op(x):
            y = jnp.logical_not(x) if x.dtype == jnp.bool_ else x + x
            if body == "error_if":
                y = eqx.error_if(y, jnp.any(y != y), "unequal to itself")
            elif body == "debug_callback":
                jax.debug.callback(_noop, y)
            elif body == "pure_callback":
                struct = jax.ShapeDtypeStruct(y.shape, y.dtype, weak_type=y.weak_type)
                y = jax.pure_callback(_host_identity, struct, y)
            return y

        arrays, statics = eqx.partition((first, rest), eqx.is_array)
        return {"out": jtu.tree_map(op, arrays), "statics": statics}

    return fn


_DONATED_ARGS = {mode: _donated_args(mode) for mode in _DONATE}


class _JitOracle:
    """`jax.jit` on the partitioned leaves: one `jax.jit` per static part, as
    `eqx.filter_jit` keys its cache."""

    def __init__(self, fn, sharding, donate):
        self.fn = fn
        self.sharding = sharding
        self.donate = _DONATED_ARGS[donate]
        self.jits = {}

    def __call__(self, first, rest):
        dynamic, static = eqx.partition((first, rest), eqx.is_array)
        static_leaves, static_def = jtu.tree_flatten(static)
        key = (static_def, tuple(static_leaves))
        if key not in self.jits:
            out_static = []

            def g(*dynamic):
                out = self.fn(*eqx.combine(dynamic, static))
                out_dynamic, out_static_part = eqx.partition(out, eqx.is_array)
                out_static[:] = [out_static_part]
                return out_dynamic

            jitted = jax.jit(
                g,
                in_shardings=self.sharding,
                out_shardings=self.sharding,
                donate_argnums=self.donate,
            )
            self.jits[key] = (jitted, out_static)
        jitted, out_static = self.jits[key]
        return eqx.combine(jitted(*dynamic), out_static[0])


#
# Comparisons.
#


def _is_none(x):
    return x is None


def _check_outputs(out, expected, sharded: bool):
    assert jtu.tree_structure(out, is_leaf=_is_none) == jtu.tree_structure(
        expected, is_leaf=_is_none
    )
    for a, b in zip(
        jtu.tree_leaves(out, is_leaf=_is_none),
        jtu.tree_leaves(expected, is_leaf=_is_none),
    ):
        if not eqx.is_array(b):
            assert a is b, (a, b)
            continue
        assert eqx.is_array(a), (a, b)
        assert (a.shape, a.dtype, a.weak_type) == (b.shape, b.dtype, b.weak_type), (
            a,
            b,
        )
        np.testing.assert_array_equal(np.array(a, copy=True), np.array(b, copy=True))
        if sharded:
            assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (
                a.sharding,
                b.sharding,
            )


def _check_inputs(ours_in, oracle_in, before, donate: str):
    """Only donated arrays deleted, at least those the oracle deleted; the others
    unchanged."""
    donated_args = _DONATED_ARGS[donate]
    for i, (mine, theirs, host) in enumerate(zip(ours_in, oracle_in, before)):
        for path_leaf, other, value in zip(
            jtu.tree_leaves_with_path(mine),
            jtu.tree_leaves(theirs),
            jtu.tree_leaves(host),
        ):
            path, x = path_leaf
            if not isinstance(x, jax.Array):
                continue
            where = f"argument {i}{jtu.keystr(path)}"
            if x.is_deleted():
                assert i in donated_args, f"{where} deleted but not donated"
                continue
            assert not (isinstance(other, jax.Array) and other.is_deleted()), (
                f"{where}: the oracle deleted it (donated), ours kept it"
            )
            np.testing.assert_array_equal(np.array(x, copy=True), value, err_msg=where)


#
# The state machine.
#


class Machine(RuleBasedStateMachine):
    @initialize(
        body=st.sampled_from(_BODIES),
        placement=st.sampled_from(_PLACEMENTS),
        donate=st.sampled_from(_DONATE),
    )
    def setup(self, body, placement, donate):
        self.counts = {"ours": 0, "oracle": 0}
        self.donate = donate
        self.split = placement == "split"
        if placement == "none":
            self.sharding = None
            self.ours = eqxs.filter_jit(
                _make_body(body, self.counts, "ours"), donate=donate
            )
            self.oracle = eqx.filter_jit(
                _make_body(body, self.counts, "oracle"), donate=donate
            )
        else:
            mesh = cached_mesh("1d", AxisType.Auto)
            self.sharding = NamedSharding(mesh, P("x") if self.split else P())
            self.ours = eqxs.filter_jit(
                _make_body(body, self.counts, "ours"),
                in_shardings=self.sharding,
                out_shardings=self.sharding,
                donate=donate,
            )
            self.oracle = _JitOracle(
                _make_body(body, self.counts, "oracle"), self.sharding, donate
            )

    def _oracle_call(self, args):
        with warnings.catch_warnings():
            # jax.jit's own warning; eqx.filter_jit and ours filter it for "all".
            warnings.filterwarnings("ignore", "Some donated buffers were not usable")
            return self.oracle(*args)

    def _compare(self, desc, ours_in, ours_out):
        before = snapshot(_materialise(desc, self.sharding))
        oracle_in = _materialise(desc, self.sharding)
        expected = self._oracle_call(oracle_in)
        _check_outputs(ours_out, expected, self.sharding is not None)
        _check_inputs(ours_in, oracle_in, before, self.donate)

    @rule(data=st.data())
    def call(self, data):
        split = getattr(self, "split", False)
        desc = (data.draw(_trees(split)), data.draw(_trees(split)))
        ours_in = _materialise(desc, self.sharding)
        self._compare(desc, ours_in, self.ours(*ours_in))

    @rule(data=st.data(), threads=st.integers(2, 4))
    def call_from_threads(self, data, threads):
        split = getattr(self, "split", False)
        desc = (data.draw(_trees(split)), data.draw(_trees(split)))
        inputs = [_materialise(desc, self.sharding) for _ in range(threads)]
        outputs: list = [None] * threads
        errors: list = []

        def work(i):
            try:
                outputs[i] = self.ours(*inputs[i])
            except BaseException as e:  # reported in the main thread
                errors.append(e)

        workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        if errors:
            raise errors[0]
        for ours_in, ours_out in zip(inputs, outputs):
            self._compare(desc, ours_in, ours_out)

    @invariant()
    def traces_no_more_than_the_oracle(self):
        counts = getattr(self, "counts", None)
        if counts is not None:
            assert counts["ours"] <= counts["oracle"], counts


# The default run tries 4 sequences; the `slow` one 20.
class TestDifferential(Machine.TestCase):
    settings = settings(examples(ci=4), stateful_step_count=_STEPS)


@pytest.mark.slow
class TestDifferentialLonger(Machine.TestCase):
    settings = settings(examples(ci=20), stateful_step_count=_STEPS)
