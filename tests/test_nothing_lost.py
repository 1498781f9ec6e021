"""A stateful property test of the rule: *an array the caller did not donate is never
deleted or changed by any call of this package, nor by a later call that donates an
array this package returned*; and no call crashes the process.

`NothingLost` keeps a pool of live PyTrees: random trees from tests/strategies.py
(dicts, lists, tuples and Modules of JAX arrays, uncommitted or placed, NumPy arrays,
typed PRNG keys and non-array leaves) and real Equinox models, plus every tree this
package returned. Its rules place trees (`filter_device_put`, eager `filter_shard`),
call `filter_jit` with every donation mode and random shardings, compile ahead of time
and call the compiled object, donate a returned tree again, and pass donated trees
again (which must raise a `RuntimeError`). It records, for every array it has seen, an
independent copy of its value, taken before anything could donate it; after every step
it asserts that every array the sequence did not donate is alive and unchanged.

References are never NumPy views of live arrays: on CPU a view pins the buffer and XLA
then declines to donate it, which would hide exactly the deletion looked for here.

Calls that plain JAX lets crash the process (a compiled object called again with an
input it donated, one buffer in two donated arguments of a compiled object) run in a
child process first (`test_crash_paths_in_a_child`); the state machine takes those
paths in this process only when that child survived.
"""

import functools as ft
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
from hypothesis import event, note, settings
from hypothesis.stateful import (
    initialize,
    invariant,
    precondition,
    rule,
    RuleBasedStateMachine,
)
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from .helpers import make_module
from .hypothesis_profiles import examples, LONG
from .isolated import Isolated, run_isolated
from .strategies import (
    arrays_st,
    cached_mesh,
    expected_shardings,
    fitting_pspecs,
    is_node,
    mesh_context,
    MESHES,
    spec_leaves_st,
    trees_st,
)


_DONATE_MODES = tuple(donation.MODES)
_DONATION_WARNING = "Some donated buffers were not usable"


#
# Values: independent host copies, and what a function should make of them.
#


def _is_key(x) -> bool:
    return jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _reference(x) -> np.ndarray:
    """An independent host copy of an array leaf's value (a key array's key data). The
    temporary host value is dropped at once, so it pins no buffer."""
    if _is_key(x):
        x = jax.random.key_data(x)
    return np.array(jax.device_get(x), copy=True)


def _check_value(x, ref: np.ndarray, where: str) -> None:
    """`x` is alive and has the value `ref`, on every device that holds a part of it
    (a replicated array whose buffer on one device was donated elsewhere reads as
    alive, and right, on the others)."""
    if not isinstance(x, jax.Array):
        got = np.array(x, copy=True)
        assert got.dtype == ref.dtype, (where, got.dtype, ref.dtype)
        np.testing.assert_array_equal(got, ref, err_msg=f"{where} changed")
        return
    assert not x.is_deleted(), f"{where} was deleted"
    data = jax.random.key_data(x) if _is_key(x) else x
    for shard in data.addressable_shards:
        part = shard.data
        assert not part.is_deleted(), f"{where}: its part on {shard.device} deleted"
        got = np.array(jax.device_get(part), copy=True)
        del part
        assert got.dtype == ref.dtype, (where, got.dtype, ref.dtype)
        np.testing.assert_array_equal(
            got, ref[shard.index], err_msg=f"{where}: its part on {shard.device}"
        )


def _double(tree):
    return jtu.tree_map(lambda x: x * 2 if eqx.is_inexact_array(x) else x, tree)


@ft.cache
def _functions(mesh) -> dict:
    """The functions called under `mesh`: new function objects per mesh, so that no
    cache of `filter_jit` (per function) carries over from an example on another
    mesh. (Such a carry-over makes a call fail with JAX's 'context mesh ... should
    match the aval mesh' ValueError in one sequence but not in its replay.)"""
    del mesh

    def double(tree):
        return _double(tree)

    def identity(tree):
        return tree

    def double2(a, b):
        return _double((a, b))

    def identity2(a, b):
        return (a, b)

    return {
        ("double", 1): double,
        ("identity", 1): identity,
        ("double", 2): double2,
        ("identity", 2): identity2,
    }


def _doubled(leaf, ref: np.ndarray) -> np.ndarray:
    """What `_double` makes of `leaf`, from its reference value."""
    # As `eqx.is_inexact_array` of a traced leaf: NumPy's `issubdtype` would miss
    # bfloat16. Keys, integers and booleans come back as they are.
    if not _is_key(leaf) and jnp.issubdtype(leaf.dtype, jnp.inexact):
        return (ref * np.array(2, ref.dtype)).astype(ref.dtype)
    return ref


def _same(leaf, ref: np.ndarray) -> np.ndarray:
    del leaf
    return ref


def _buffers(x) -> list[int]:
    if _is_key(x):
        x = jax.random.key_data(x)
    return [s.data.unsafe_buffer_pointer() for s in x.addressable_shards]


def _aliased(args) -> tuple[bool, bool]:
    """(an array object reachable twice, two distinct arrays sharing a buffer)."""
    arrays = [x for x in jtu.tree_leaves(args) if isinstance(x, jax.Array)]
    unique = {id(x): x for x in arrays}
    pointers = [p for x in unique.values() for p in _buffers(x)]
    return len(unique) < len(arrays), len(set(pointers)) < len(pointers)


def _deleted(tree) -> bool:
    return any(
        isinstance(x, jax.Array) and x.is_deleted() for x in jtu.tree_leaves(tree)
    )


#
# The paths that crash plain JAX, first in a child process.
#

_CRASH_PATHS = """
import equinox_shard as eqxs
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
s = NamedSharding(mesh, P("x"))
double = lambda t: jtu.tree_map(lambda x: 2 * x, t)
value = np.arange(32.0, dtype=np.float32).reshape(8, 4)
out = {}

# A compiled object called again with the input it donated.
a = {"w": jax.device_put(jnp.asarray(value), s)}
c = eqxs.filter_jit(double, donate="all").lower(a).compile()
c(a)
try:
    c(a)
    out["again"] = "no exception"
except RuntimeError as e:
    out["again"] = str(e)

# One buffer in two donated arguments of a compiled object: refused.
b = jax.device_put(jnp.asarray(value), s)
struct = jax.ShapeDtypeStruct(b.shape, b.dtype, sharding=s)
f = eqxs.filter_jit(lambda x, y: x + 2 * y, donate="all")
c2 = f.lower(struct, struct).compile()
try:
    c2(b, b)
    raised = "no exception"
except ValueError as e:
    raised = str(e)
out["twice"] = [
    raised.startswith("x and y are the same array"),
    not b.is_deleted(),
    bool(np.array_equal(np.array(b, copy=True), value)),
]
report(out)
"""


@ft.cache
def _crash_paths() -> Isolated:
    return run_isolated(_CRASH_PATHS, timeout=120)


def _crash_paths_survive() -> bool:
    run = _crash_paths()
    return (
        run.returncode == 0
        and run.result is not None
        and "has been deleted" in run.result["again"]
        and run.result["twice"] == [True, True, True]
    )


def test_crash_paths_in_a_child():
    run = _crash_paths()
    assert run.returncode == 0, run
    assert run.result["again"].startswith("t['w']: this array has been deleted"), run
    assert run.result["twice"] == [True, True, True], run


#
# The state machine.
#


class NothingLost(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.kind = "1d"
        self.mesh: Any = None
        # id -> (array, reference value, where it came from); only arrays that the
        # sequence has not donated. Holding the array does not pin its buffer.
        self.records: dict[int, tuple[Any, np.ndarray, str]] = {}
        # (name, tree, returned by this package); every array leaf is in `records`.
        self.pool: list[tuple[str, Any, bool]] = []
        # Trees with at least one donated array leaf.
        self.donated: list[tuple[str, Any]] = []
        # (compiled object, the arguments it donated), for calling it again.
        self.compiled: list[tuple[Any, tuple]] = []
        self.count = 0

    # Bookkeeping.

    def _name(self, what: str) -> str:
        self.count += 1
        return f"t{self.count}<{what}>"

    def _add(self, tree, name: str, returned: bool) -> None:
        for path, leaf in jtu.tree_flatten_with_path(tree)[0]:
            if eqx.is_array(leaf) and id(leaf) not in self.records:
                self.records[id(leaf)] = (
                    leaf,
                    _reference(leaf),
                    name + jtu.keystr(path),
                )
        self.pool.append((name, tree, returned))
        note(f"{name}: {len(jtu.tree_leaves(tree))} leaves")

    def _draw_tree(self, data, label: str):
        placements = lambda shape: (
            [
                NamedSharding(self.mesh, p)
                for p in fitting_pspecs(self.mesh, self.kind, [shape])
            ]
            + [jax.sharding.make_single_device_sharding(d) for d in jax.devices()[::3]]
        )
        model = data.draw(st.sampled_from(["none", "mlp", "linear"]), label=label)
        tree = data.draw(trees_st(arrays_st(placements=placements)), label=label)
        if model == "mlp":
            tree = {"model": make_module(eqx.nn.MLP, 8, 4, 16, 1), "rest": tree}
        elif model == "linear":
            tree = [make_module(eqx.nn.Linear, 8, 16), tree]
        return tree

    def _pick(self, data, *, returned_only=False) -> tuple[str, Any]:
        # Draw a name, not the tree: Hypothesis would print the tree's arrays.
        # An index drawn from a fixed range: the draws then do not depend on how
        # many trees there are, which helps Hypothesis replay a sequence.
        trees = [(n, t) for n, t, r in self.pool if r or not returned_only]
        return trees[data.draw(st.integers(0, 15), label="tree") % len(trees)]

    def _draw_spec(self, data, value, *, bare: bool, single_device: bool, label: str):
        """A random valid specification for `value`, as `specs_st` of
        tests/strategies.py draws them, except that an Equinox layer gets one
        spec leaf: a spec shaped like an `eqx.nn.MLP` is callable, and so would read
        as a callable spec leaf."""

        def spec_for(node):
            if (
                is_node(node)
                and not isinstance(node, (eqx.nn.MLP, eqx.nn.Linear))
                and data.draw(st.booleans(), label=label)
            ):
                is_child = lambda y: y is not node
                children, treedef = jtu.tree_flatten(node, is_leaf=is_child)
                return jtu.tree_unflatten(treedef, [spec_for(c) for c in children])
            arrays = [x for x in jtu.tree_leaves(node) if eqx.is_array(x)]
            return data.draw(
                spec_leaves_st(
                    arrays, self.mesh, self.kind, bare=bare, single_device=single_device
                ),
                label=label,
            )

        return spec_for(value)

    def _finish(self, name, args, out, donated: list, transform) -> None:
        """After a successful call: the leaves of `out` correspond to those of
        `args`, are alive, and have the values `transform(input, its reference)`;
        `donated` (input arrays) leave the records, and the trees holding them the
        pool; `out` joins the pool."""
        in_leaves = jtu.tree_leaves(args)
        out_leaves = jtu.tree_leaves(out)
        assert len(in_leaves) == len(out_leaves), (len(in_leaves), len(out_leaves))
        expected = [
            transform(x, self.records[id(x)][1]) if eqx.is_array(x) else None
            for x in in_leaves
        ]
        gone = {
            id(x): self.records.pop(id(x)) for x in donated if id(x) in self.records
        }
        if gone:
            still = []
            for entry in self.pool:
                if any(id(x) in gone for x in jtu.tree_leaves(entry[1])):
                    self.donated.append(entry[:2])
                else:
                    still.append(entry)
            self.pool = still
        for (path, y), value in zip(jtu.tree_flatten_with_path(out)[0], expected):
            if value is None:
                continue
            where = name + jtu.keystr(path)
            _check_value(y, value, where)
            if id(y) in gone:  # Donated but returned as the same object: alive.
                self.records[id(y)] = gone[id(y)]
            elif id(y) not in self.records:
                self.records[id(y)] = (y, value, where)
        self.pool.append((name, out, True))

    # Rules.

    @initialize(
        kind=st.sampled_from(list(MESHES)),
        axis_type=st.sampled_from([AxisType.Auto, AxisType.Explicit]),
        data=st.data(),
    )
    def start(self, kind, axis_type, data):
        self.kind = kind
        self.mesh = cached_mesh(kind, axis_type)
        self._add(self._draw_tree(data, "first tree"), self._name("user"), False)

    @rule(data=st.data())
    def new_tree(self, data):
        self._add(self._draw_tree(data, "new tree"), self._name("user"), False)

    @precondition(lambda self: self.pool)
    @rule(data=st.data())
    def place(self, data):
        """`filter_device_put` (random `donate`, `may_alias`) or eager `filter_shard`
        of any live tree, a user's or one returned earlier (so: re-placing)."""
        name, tree = self._pick(data)
        how = data.draw(st.sampled_from(["put", "put", "shard"]), label="function")
        bare = data.draw(st.booleans(), label="bare PartitionSpecs")
        spec = self._draw_spec(data, tree, bare=bare, single_device=True, label="spec")
        donate = False
        note(f"{how}({name})")
        with mesh_context(self.mesh, bare):
            targets = expected_shardings(tree, spec)
            try:
                if how == "put":
                    donate = data.draw(st.booleans(), label="donate")
                    may_alias = data.draw(
                        st.sampled_from([None, False]), label="may_alias"
                    )
                    out = eqxs.filter_device_put(
                        tree, spec, donate=donate, may_alias=may_alias
                    )
                else:
                    out = eqxs.filter_shard(tree, spec)
            except Exception as e:
                # JAX may refuse a transfer (e.g. a reshard it cannot slice on
                # Explicit axes): an error is allowed, a loss is not (the invariant).
                note(f"{how}({name}) raised {type(e).__name__}: {e}")
                event(f"place raised {type(e).__name__}")
                return
        donated = [
            x
            for x, s in zip(jtu.tree_leaves(tree), targets)
            if donate and s is not None and isinstance(x, jax.Array)
        ]
        self._finish(self._name(f"{how}({name})"), tree, out, donated, _same)

    def _draw_jit(self, data, *, returned_only=False, donate=None):
        arity = data.draw(st.sampled_from([1, 1, 2]), label="arity")
        args = tuple(
            self._pick(data, returned_only=returned_only) for _ in range(arity)
        )
        names = ", ".join(n for n, _ in args)
        args = tuple(t for _, t in args)
        what = data.draw(st.sampled_from(["double", "identity"]), label="function")
        if donate is None:
            donate = data.draw(st.sampled_from(_DONATE_MODES), label="donate")
        bare = data.draw(st.booleans(), label="bare PartitionSpecs")
        specs = lambda value, label: self._draw_spec(
            data, value, bare=bare, single_device=False, label=label
        )
        kwargs = {}
        how_in = data.draw(st.sampled_from(["unset", "one", "per argument"]))
        if how_in == "one":
            kwargs["in_shardings"] = specs(list(args), "in_shardings")
            if isinstance(kwargs["in_shardings"], list):  # not a single leaf
                kwargs["in_shardings"] = tuple(kwargs["in_shardings"])
        elif how_in == "per argument":
            kwargs["in_shardings"] = tuple(specs(a, "in_shardings") for a in args)
        if data.draw(st.booleans(), label="out_shardings"):
            out = args[0] if arity == 1 else args
            kwargs["out_shardings"] = specs(out, "out_shardings")
        f = eqxs.filter_jit(_functions(self.mesh)[what, arity], donate=donate, **kwargs)
        explicit = self.mesh.axis_types[0] == AxisType.Explicit
        transform = _doubled if what == "double" else _same
        label = f"{what}[{donate}]({names})"
        return (
            f,
            args,
            donate,
            transform,
            label,
            mesh_context(self.mesh, bare or explicit),
        )

    def _donated_by(self, donate: str, args: tuple) -> list:
        """The arrays a call donates: those in donated positions, except an array
        reachable twice, which is kept (or, donated twice, refused)."""
        donates, _ = donation.MODES[donate]
        positions = [a for p, a in enumerate(args) if donates(p, len(args))]
        counts: dict[int, int] = {}
        for x in jtu.tree_leaves(args):
            if isinstance(x, jax.Array):
                counts[id(x)] = counts.get(id(x), 0) + 1
        return [
            x
            for x in jtu.tree_leaves(positions)
            if isinstance(x, jax.Array) and counts[id(x)] == 1
        ]

    def _run(self, call, warns: bool):
        """Calls `call()`, which may warn that a donation was declined (a 'warn' mode;
        lowering for ahead-of-time compilation): that warning is recorded, every other
        is still an error."""
        if not warns:
            return call()
        with warnings.catch_warnings(record=True) as caught:
            warnings.filterwarnings("always", message=_DONATION_WARNING)
            out = call()
        for w in caught:
            assert _DONATION_WARNING in str(w.message), w
            event("donation declined, with a warning")
        return out

    def _jit(self, data, *, aot: bool, returned_only=False, donate=None):
        f, args, donate, transform, label, context = self._draw_jit(
            data, returned_only=returned_only, donate=donate
        )
        twice, shared = _aliased(args)
        if shared or (aot and twice):
            # Plain JAX crashes here: take this path only if the child survived it.
            event("aliased arguments" + (" (skipped)" if aot else ""))
            if not _crash_paths_survive():
                return
        donated = self._donated_by(donate, args)
        note(f"{'aot' if aot else 'jit'} {label}, donating {len(donated)} arrays")
        compiled = None
        try:
            with context:
                warns = not donation.MODES[donate][1]  # the warning not filtered
                if aot:
                    # `.lower` warns of a declined donation in every mode.
                    compiled = self._run(lambda: f.lower(*args).compile(), True)
                    out = self._run(lambda: compiled(*args), warns)
                else:
                    out = self._run(lambda: f(*args), warns)
        except (ValueError, TypeError, jax.errors.JaxRuntimeError) as e:
            # A committed argument elsewhere than its `in_shardings`, or on another
            # device set, or XLA refusing to compile an aliasing it cannot honour:
            # refused before anything runs, so nothing is donated.
            event(f"{'aot' if aot else 'jit'}: {type(e).__name__}")
            note(f"{label} raised {type(e).__name__}: {str(e)[:200]}")
            return
        event(f"{'aot' if aot else 'jit'}: ran")
        out_args = args[0] if len(args) == 1 else args
        self._finish(self._name(label), out_args, out, donated, transform)
        if compiled is not None and donated:
            self.compiled.append((compiled, args))

    @precondition(lambda self: self.pool)
    @rule(data=st.data())
    def jit_call(self, data):
        """`filter_jit` (elementwise or identity) with a random donation mode and
        random `in_shardings`/`out_shardings`; two arguments may be one tree."""
        self._jit(data, aot=False)

    @precondition(lambda self: self.pool)
    @rule(data=st.data())
    def aot_call(self, data):
        """The same, through `.lower(...).compile()` and a call of the result."""
        self._jit(data, aot=True)

    @precondition(lambda self: any(r for _, _, r in self.pool))
    @rule(data=st.data())
    def donate_returned(self, data):
        """A tree this package returned, donated to `filter_jit(donate="all")`."""
        self._jit(data, aot=False, returned_only=True, donate="all")

    @precondition(lambda self: self.donated)
    @rule(data=st.data())
    def pass_donated_again(self, data):
        """A tree that holds a donated (and deleted) array, passed again: a
        `RuntimeError` naming it, never a crash or a silent success."""
        i = data.draw(st.integers(0, 15), label="donated tree")
        how = data.draw(st.sampled_from(["jit", "put", "shard"]), label="function")
        name, tree = self.donated[i % len(self.donated)]
        if not _deleted(tree):
            event("donation declined: nothing deleted")
            return
        replicated = NamedSharding(self.mesh, P())
        double = _functions(self.mesh)["double", 1]
        calls = {
            "jit": lambda: eqxs.filter_jit(double, donate="all")(tree),
            "put": lambda: eqxs.filter_device_put(tree, replicated),
            "shard": lambda: eqxs.filter_shard(tree, replicated),
        }
        with pytest.raises(RuntimeError, match="has been deleted"):
            with jax.set_mesh(self.mesh):
                calls[how]()
        note(f"{how}({name}) raised RuntimeError")

    @precondition(lambda self: self.compiled)
    @rule(data=st.data())
    def call_compiled_again(self, data):
        """A compiled object called again with the arguments it donated."""
        i = data.draw(st.integers(0, 15), label="compiled")
        compiled, args = self.compiled[i % len(self.compiled)]
        if not _deleted(args):
            event("donation declined: nothing deleted")
            return
        if not _crash_paths_survive():
            event("compiled again (skipped)")
            return
        with pytest.raises(RuntimeError, match="has been deleted"):
            compiled(*args)

    # The invariant.

    @invariant()
    def nothing_lost(self):
        """Every array the sequence has not donated is alive and unchanged."""
        for x, ref, where in self.records.values():
            _check_value(x, ref, where)


def _settings(ci: int) -> settings:
    # In CI the sequences are fixed (derandomized), so that a red run can be replayed;
    # `--hypothesis-profile=long` draws new ones.
    return settings(
        examples(ci=ci),
        stateful_step_count=15,
        derandomize=settings.get_current_profile_name() != LONG,
        database=None,
    )


# The default run tries 4 sequences; the `slow` one 20.
class TestNothingLost(NothingLost.TestCase):
    settings = _settings(4)


@pytest.mark.slow
class TestNothingLostLonger(NothingLost.TestCase):
    settings = _settings(20)
