"""Bad inputs to `filter_device_put`, `filter_shard` and `filter_jit`, one test each.

Every mistake must end in an exception of the documented type, raised before anything
is transferred or run, whose message names the offending leaf by its key path, as
`jax.tree_util.keystr` prints it, rooted at the user's own argument (`x['b'][0]`,
`model.layers[0].weight`, `out[1]`), never at an internal name; and every input array
must still be alive, with the same values and the same sharding.

Where the right behaviour is not what the library does today, the test is written for
the right behaviour and marked `xfail(strict=True)` with the reason.
"""

import ast
import contextlib
import functools as ft
import inspect
import pathlib
import re
from typing import Any

import equinox as eqx
import equinox_shard as eqxs
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import pytest
from jax.sharding import make_single_device_sharding, NamedSharding, PartitionSpec as P

from .helpers import (
    assert_alive,
    assert_array_shardings,
    assert_same_values,
    auto_mesh,
    grid_shape,
    make_module,
    mixed_mesh,
    nth_device,
    snapshot,
)
from .isolated import run_isolated


def _internal_names() -> tuple[str, ...]:
    """Names that belong to the implementation, not to the user's arguments, read from
    the package itself: each module's file (as a traceback prints it), each function
    it defines with an underscore inside its name (an English word has none), and
    each parameter name of its functions, longer than a letter, followed by `[` (the
    root of a key path); less the names that messages do give: the public API's own
    (its functions, classes, methods and their parameters) and JAX's."""
    package = pathlib.Path(eqxs.__file__).parent
    public = {"out"}  # the root of an output's key paths (`out[1]`)
    for name in eqxs.__all__:
        value = getattr(eqxs, name)
        methods = vars(value).values() if isinstance(value, type) else ()
        public |= {name, *dir(value)}
        for member in (value, *methods):
            with contextlib.suppress(TypeError, ValueError):
                public |= set(inspect.signature(member).parameters)
    names = set()
    for path in package.rglob("*.py"):
        names.add(path.relative_to(package.parent).as_posix())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and "_" in node.name.strip("_"):
                names.add(node.name)
            elif isinstance(node, ast.arg) and len(node.arg) > 1:
                names.add(node.arg + "[")
    return tuple(
        sorted(
            name
            for name in names
            if name.removesuffix("[") not in public
            and not any(hasattr(m, name) for m in (jax, jax.sharding, jtu, eqx))
        )
    )


_INTERNAL = _internal_names()


def _kp(root: str, *keys) -> str:
    """`root` followed by `keys` as `jax.tree_util.keystr` prints them: a `str` is a
    dict key, an `int` a sequence index, and `'.name'` an attribute."""
    path = []
    for key in keys:
        if isinstance(key, int):
            path.append(jtu.SequenceKey(key))
        elif key.startswith("."):
            path.append(jtu.GetAttrKey(key[1:]))
        else:
            path.append(jtu.DictKey(key))
    return root + jtu.keystr(tuple(path))


def _names(message: str, path: str) -> bool:
    """Whether `message` names `path` itself: not only a longer path that starts with
    it, nor a longer name that ends with it."""
    pattern = r"(?<![\w.\]])" + re.escape(path) + r"(?![\w.\[])"
    return re.search(pattern, message) is not None


class _Intact:
    """Snapshots the array leaves of some PyTrees (values and shardings); `check`
    asserts that none was deleted, changed value, or moved."""

    def __init__(self, trees):
        self.trees = trees
        self.values = snapshot(trees)
        self.shardings = [
            x.sharding if isinstance(x, jax.Array) else None
            for x in jtu.tree_leaves(trees)
        ]

    def check(self):
        assert_alive(self.trees)
        assert_same_values(self.trees, self.values)
        for x, sharding in zip(jtu.tree_leaves(self.trees), self.shardings):
            if sharding is not None:
                assert x.sharding == sharding, (x.sharding, sharding)


@contextlib.contextmanager
def _raises(exc_type, *paths, inputs=(), internal=_INTERNAL, match=None):
    """Expects `exc_type` from the body, whose message names every path in `paths`
    and no internal name, and leaves the arrays of `inputs` intact."""
    intact = _Intact(inputs)
    with pytest.raises(exc_type) as info:
        yield info
    message = str(info.value)
    for path in paths:
        assert _names(message, path), (path, message)
    for name in internal:
        assert name not in message, (name, message)
    if match is not None:
        assert re.search(match, message), (match, message)
    intact.check()


#
# The three ways of applying a specification to a PyTree `x`. "traced" is
# `filter_shard` inside a JIT'd function: its errors are raised whilst tracing.
#


def _traced_shard(x, spec):
    return eqx.filter_jit(eqxs.filter_shard)(x, spec)


_APPLY = {
    "filter_device_put": eqxs.filter_device_put,
    "filter_shard": eqxs.filter_shard,
    "filter_shard traced": _traced_shard,
}
_EAGER = {k: _APPLY[k] for k in ("filter_device_put", "filter_shard")}
apply_modes = pytest.mark.parametrize("apply", list(_APPLY.values()), ids=list(_APPLY))
eager_modes = pytest.mark.parametrize("apply", list(_EAGER.values()), ids=list(_EAGER))


class _Linear(eqx.Module):
    weight: Any
    bias: Any


class _Other(eqx.Module):
    weight: Any
    bias: Any


def _tree():
    return {
        "a": jnp.arange(8.0),
        "b": [jnp.arange(16.0).reshape(8, 2), 3],
        "c": {"d": jnp.ones(8, jnp.int32), "e": "static"},
    }


def _sharded():
    mesh = auto_mesh()
    return NamedSharding(mesh, P("x")), NamedSharding(mesh, P())


#
# The specification is not a prefix of the value.
#


@apply_modes
def test_spec_missing_key(apply):
    x = _tree()
    s, r = _sharded()
    with _raises(ValueError, _kp("x", "c", "e"), inputs=x):
        apply(x, {"a": s, "b": r, "c": {"d": s}})


@apply_modes
def test_spec_extra_key(apply):
    x = _tree()
    s, r = _sharded()
    with _raises(ValueError, _kp("x", "c", "f"), inputs=x):
        apply(x, {"a": s, "b": r, "c": {"d": s, "e": None, "f": s}})


@apply_modes
def test_spec_tuple_for_list(apply):
    x = _tree()
    s, r = _sharded()
    with _raises(ValueError, _kp("x", "b"), inputs=x, match="tuple.*list"):
        apply(x, {"a": s, "b": (r, None), "c": r})


@apply_modes
def test_spec_list_of_wrong_length(apply):
    x = _tree()
    s, r = _sharded()
    with _raises(ValueError, _kp("x", "b"), inputs=x, match="length 3.*length 2"):
        apply(x, {"a": s, "b": [r, None, r], "c": r})


@apply_modes
def test_spec_deeper_than_value(apply):
    x = _tree()
    s, r = _sharded()
    with _raises(ValueError, _kp("x", "a"), inputs=x):
        apply(x, {"a": {"z": s}, "b": r, "c": r})


@apply_modes
def test_spec_module_of_another_type(apply):
    x = {"layer": _Linear(jnp.ones((8, 2)), jnp.zeros(8))}
    s, r = _sharded()
    with _raises(ValueError, _kp("x", "layer"), inputs=x, match="_Other"):
        apply(x, {"layer": _Other(s, r)})


@apply_modes
def test_spec_module_with_other_static_fields(apply):
    # The message names the static field that differs (it showed Equinox's raw static
    # data, '(Missing, True, True, 2, 2, 8, 1, False) vs (...)', before issue 62).
    model = make_module(eqx.nn.MLP, 2, 2, 6, 1)
    spec = jtu.tree_map(lambda _: None, make_module(eqx.nn.MLP, 2, 2, 8, 1))
    with _raises(ValueError, "x", inputs=model, match="width_size"):
        apply(model, spec)


#
# A specification leaf of the wrong type.
#


@eager_modes
@pytest.mark.parametrize("leaf", ["x", 3, 1.5], ids=["str", "int", "float"])
def test_spec_leaf_wrong_type(apply, leaf):
    x = _tree()
    s, r = _sharded()
    with _raises(TypeError, _kp("device_or_shardings", "a"), inputs=x):
        apply(x, {"a": leaf, "b": r, "c": r})


@eager_modes
def test_spec_tuple_of_axis_names(apply):
    # `("x",)` where `P("x")` was meant: a tuple is a PyTree node, "x" its leaf.
    x = _tree()
    s, r = _sharded()
    with _raises(TypeError, _kp("device_or_shardings", "a", 0), inputs=x):
        apply(x, {"a": ("x",), "b": r, "c": r})


@eager_modes
def test_arguments_swapped(apply):
    x = {"a": jnp.arange(8.0)}
    s, _ = _sharded()
    with _raises(TypeError, _kp("device_or_shardings", "a"), inputs=x, match="Array"):
        apply(s, x)


@eager_modes
def test_spec_leaf_is_a_mesh(apply):
    x = _tree()
    _, r = _sharded()
    with _raises(
        TypeError, _kp("device_or_shardings", "a"), inputs=x, match="NamedSharding"
    ):
        apply(x, {"a": auto_mesh(), "b": r, "c": r})


@eager_modes
def test_spec_leaf_is_a_class(apply):
    x = _tree()
    _, r = _sharded()
    with _raises(
        TypeError, _kp("device_or_shardings", "a"), inputs=x, match="PartitionSpec"
    ):
        apply(x, {"a": P, "b": r, "c": r})


def test_spec_leaf_wrong_type_lists_what_is_taken_there():
    # `in_shardings` refuses a `jax.memory.Space`, and a function that only reads
    # shardings a `Format` and a `Space`: the error does not offer them there.
    def kinds_offered(call) -> list[str]:
        with pytest.raises(TypeError, match="specification leaf must be") as info:
            call()
        return re.findall(r"`(jax\.[\w.]+)`", str(info.value))

    sharding, layout = "jax.sharding.Sharding", "jax.experimental.layout.Format"
    placed = kinds_offered(lambda: eqxs.filter_device_put(jnp.ones(8), "x"))
    assert {sharding, layout, "jax.memory.Space"} <= set(placed)
    jitted = kinds_offered(lambda: eqxs.filter_jit(lambda x: x, in_shardings="x"))
    assert jitted == [k for k in placed if k != "jax.memory.Space"]
    data = np.ones(8, np.float32)
    read = kinds_offered(
        lambda: eqxs.filter_make_array_from_process_local_data("x", data)
    )
    assert read == [k for k in placed if k not in (layout, "jax.memory.Space")]


#
# Rank and divisibility.
#


@apply_modes
def test_partition_spec_longer_than_rank(apply):
    x = _tree()
    mesh = auto_mesh()
    spec = {"a": NamedSharding(mesh, P("x", None)), "b": None, "c": None}
    with _raises(ValueError, _kp("x", "a"), inputs=x, match=r"rank 1"):
        apply(x, spec)


@apply_modes
@pytest.mark.parametrize(
    "scalar",
    [lambda: jnp.float32(1.0), lambda: np.float32(1.0), lambda: jnp.array(1)],
    ids=["jax", "numpy scalar", "jax int"],
)
def test_scalar_with_partitioned_spec(apply, scalar):
    x = {"w": jnp.arange(8.0), "step": scalar()}
    s, _ = _sharded()
    with _raises(ValueError, _kp("x", "step"), inputs=x, match=r"P\(\)"):
        apply(x, s)


@apply_modes
@pytest.mark.devices(8, reason="a dimension size that 8 devices do not divide")
def test_indivisible_dimension(apply):
    x = {"a": jnp.arange(8.0), "b": [jnp.arange(10.0), 1]}
    s, _ = _sharded()
    with _raises(ValueError, _kp("x", "b", 0), inputs=x, match="10"):
        apply(x, s)


@apply_modes
@pytest.mark.devices(8, reason="a dimension size that 8 devices do not divide")
def test_indivisible_by_two_mesh_axes(apply):
    mesh = auto_mesh(grid_shape(), ("a", "b"))
    x = {"w": jnp.ones((8, 4)), "v": jnp.ones((4, 4))}
    with _raises(ValueError, _kp("x", "v"), inputs=x, match=r"\('a', 'b'\)"):
        apply(x, NamedSharding(mesh, P(("a", "b"))))


@apply_modes
@pytest.mark.devices(8, reason="a dimension size that 8 devices do not divide")
def test_indivisible_second_dimension(apply):
    mesh = auto_mesh(grid_shape(), ("a", "b"))
    x = {"w": jnp.ones((8, 4)), "v": jnp.ones((8, 3))}
    with _raises(ValueError, _kp("x", "v"), inputs=x, match="dimension 1"):
        apply(x, NamedSharding(mesh, P("a", "b")))


#
# Meshes and mesh axes.
#


@apply_modes
def test_bare_partition_spec_without_mesh(apply):
    x = _tree()
    with _raises(ValueError, _kp("x", "a"), inputs=x, match="set_mesh"):
        apply(x, {"a": P("x"), "b": None, "c": None})


@apply_modes
def test_unknown_mesh_axis(apply):
    x = _tree()
    with jax.set_mesh(auto_mesh()):
        with _raises(ValueError, _kp("x", "a"), inputs=x, match="y"):
            apply(x, {"a": P("y"), "b": None, "c": None})


@apply_modes
def test_duplicated_mesh_axis(apply):
    x = {"a": jnp.ones((8, 8))}
    with jax.set_mesh(auto_mesh()):
        with _raises(ValueError, _kp("x", "a"), inputs=x, match="x"):
            apply(x, {"a": P("x", "x")})


@pytest.mark.xfail(
    strict=True,
    reason="an unknown memory kind fails inside `jax.device_put` ('Could not find "
    "memory addressable by device cpu ... Got memory kind: nonsense'), without the "
    "key path",
)
@eager_modes
def test_unknown_memory_kind(apply):
    x = {"a": jnp.arange(8.0), "b": np.arange(8.0)}
    mesh = auto_mesh()
    spec = {"a": None, "b": NamedSharding(mesh, P("x"), memory_kind="nonsense")}
    with _raises(ValueError, _kp("x", "b"), inputs=x, match="nonsense"):
        apply(x, spec)


@eager_modes
@pytest.mark.devices(8, reason="two meshes of four devices each")
def test_two_meshes_eagerly_is_fine(apply):
    # Eagerly, each leaf is a separate transfer: different meshes (even disjoint sets
    # of devices) in one call are allowed, as in `jax.device_put`.
    x = _tree()
    devices = np.array(jax.devices())
    first = jax.sharding.Mesh(devices[:4], ("x",))
    second = jax.sharding.Mesh(devices[4:], ("x",))
    spec = {
        "a": NamedSharding(first, P("x")),
        "b": NamedSharding(second, P("x")),
        "c": make_single_device_sharding(jax.devices()[7]),
    }
    expected = snapshot(x)
    out = apply(x, spec)
    assert_same_values(out, expected)
    assert_array_shardings(out, [spec["a"], spec["b"], spec["c"]])


@pytest.mark.xfail(
    strict=True,
    reason="inside a trace, JAX raises 'Received incompatible devices for jitted "
    "computation. Got sharding_constraint inside jit with device ids [4, 5, 6, 7] ... "
    "at .../equinox_shard/_sharding.py (constrain_leaves)': no key path, and an "
    "internal source location",
)
def test_two_device_sets_traced():
    x = _tree()
    devices = np.array(jax.devices())
    first = jax.sharding.Mesh(devices, ("x",))
    second = jax.sharding.Mesh(devices[4:], ("x",))
    spec: dict[str, Any] = {"a": NamedSharding(first, P("x"))}
    spec.update(b=NamedSharding(second, P("x")), c=None)
    with _raises(ValueError, _kp("x", "a"), _kp("x", "b", 0), inputs=x):
        _traced_shard(x, spec)


def test_mixed_auto_explicit_traced():
    x = _tree()
    spec: dict[str, Any] = {"a": NamedSharding(mixed_mesh(), P(("data", "model")))}
    spec.update(b=None, c=None)
    with _raises(ValueError, _kp("x", "a"), inputs=x, match="Explicit.*Auto"):
        _traced_shard(x, spec)


@eager_modes
def test_mixed_auto_explicit_eagerly_is_fine(apply):
    # A transfer does not care about axis types; only a constraint does.
    x = _tree()
    spec: dict[str, Any] = {"a": NamedSharding(mixed_mesh(), P(("data", "model")))}
    spec.update(b=None, c=None)
    expected = snapshot(x)
    out = apply(x, spec)
    assert_same_values(out, expected)
    assert_array_shardings(out, [spec["a"], None, None])
    assert out["b"][0] is x["b"][0]


#
# Callable specifications.
#


class _Boom(Exception):
    pass


def _raising_rule(leaf):
    raise _Boom("no rule for this leaf")


@apply_modes
def test_rule_raises(apply):
    x = _tree()
    with _raises(ValueError, _kp("x", "a"), inputs=x, match="_Boom") as info:
        apply(x, {"a": _raising_rule, "b": None, "c": None})
    assert isinstance(info.value.__cause__, _Boom)


@apply_modes
@pytest.mark.parametrize(
    "returned",
    [
        lambda s: "x",
        lambda s: (s,),
        lambda s: lambda leaf: s,
        lambda s: ("x", None),
    ],
    ids=["str", "tuple of shardings", "callable", "tuple of axis names"],
)
def test_rule_returns_non_spec(apply, returned):
    x = _tree()
    s, _ = _sharded()
    rule = lambda leaf: returned(s)
    with _raises(TypeError, _kp("x", "a"), inputs=x, match="must return"):
        apply(x, {"a": rule, "b": None, "c": None})


@apply_modes
def test_rule_with_wrong_arity(apply):
    x = _tree()
    s, _ = _sharded()
    with _raises(ValueError, _kp("x", "a"), inputs=x) as info:
        apply(x, {"a": lambda: s, "b": None, "c": None})
    assert isinstance(info.value.__cause__, TypeError)


#
# Deleted inputs, and `donate`/`may_alias` flags.
#


@eager_modes
def test_deleted_input_to_be_moved(apply):
    s, r = _sharded()
    deleted = jax.device_put(jnp.arange(8.0), r)
    deleted.delete()
    x = {"a": jnp.arange(8.0), "b": deleted}
    with _raises(RuntimeError, _kp("x", "b"), inputs=x["a"], match="deleted"):
        apply(x, s)


@eager_modes
def test_deleted_input_already_placed(apply):
    s, _ = _sharded()
    deleted = jax.device_put(jnp.arange(8.0), s)
    deleted.delete()
    x = {"a": jnp.arange(8.0), "b": deleted}
    with _raises(RuntimeError, _kp("x", "b"), inputs=x["a"], match="deleted"):
        apply(x, s)


def test_donate_not_a_prefix():
    x = _tree()
    s, _ = _sharded()
    with _raises(ValueError, _kp("x", "c", "e"), inputs=x, match="donate"):
        eqxs.filter_device_put(x, s, donate={"a": True, "b": False, "c": {"d": True}})


def test_donate_leaf_not_bool():
    x = _tree()
    s, _ = _sharded()
    with _raises(TypeError, inputs=x, match="donate"):
        eqxs.filter_device_put(x, s, donate={"a": "yes", "b": False, "c": False})


def test_donate_and_may_alias():
    x = _tree()
    s, _ = _sharded()
    # Named by its key path before anything runs (JAX's own message names no leaf).
    with _raises(ValueError, "x['a']", inputs=x, match="`donate` and `may_alias`"):
        eqxs.filter_device_put(x, s, donate=True, may_alias=True)


@pytest.mark.parametrize("target", ["replicated", "single device", "device"])
@pytest.mark.parametrize("donate", [True, [True, False]], ids=["both", "one"])
def test_device_put_donating_one_buffer_twice(target, donate):
    # One array twice in the tree, donated twice, or donated once and kept once: no
    # crash, right values, and a kept reference is not deleted.
    s, r = _sharded()
    device = nth_device(3)
    target = {
        "replicated": r,
        "single device": make_single_device_sharding(device),
        "device": device,
    }[target]
    a = jax.device_put(jnp.arange(8.0), s)
    out = eqxs.filter_device_put([a, a], target, donate=donate)
    for leaf in out:
        np.testing.assert_array_equal(leaf, np.arange(8.0))
    if donate is not True:
        assert_alive(a)
        np.testing.assert_array_equal(a, np.arange(8.0))


#
# `filter_jit`: malformed configuration, raised at decoration.
#


def _step(model, batch):
    return jtu.tree_map(lambda a: a + 1, (model, batch))


@pytest.mark.parametrize("n", [1, 3])
def test_in_shardings_wrong_number_of_entries(n):
    s, r = _sharded()
    with _raises(ValueError, match=r"_step.*2 \(model, batch\).*" + str(n)):
        eqxs.filter_jit(_step, in_shardings=(r, s, s)[:n])


def test_in_shardings_entries_counted_in_words():
    s, r = _sharded()
    with _raises(ValueError, match=r"; got 1 entry\.$"):
        eqxs.filter_jit(_step, in_shardings=[r])
    x = jnp.arange(8.0)
    f = eqxs.filter_jit(lambda *xs: xs, in_shardings=(s,))
    with _raises(ValueError, inputs=x, match=r"has 1 entry but the call has 2 posi"):
        f(x, x)
    f = eqxs.filter_jit(lambda *xs: xs, in_shardings=[s, s])
    with _raises(ValueError, inputs=x, match=r"call has 1 positional argument: "):
        f(x)


@pytest.mark.devices(2, reason="P('x') and P() are the same sharding on one device")
def test_in_shardings_list_is_a_tuple():
    # As `jax.jit(in_shardings=)`, a list is one entry per positional parameter, and
    # the messages say so.
    s, r = _sharded()
    model, batch = _args()
    out = eqxs.filter_jit(_step, in_shardings=[r, s])({"w": batch[0]}, batch[0])
    assert out[1].sharding == s
    with _raises(ValueError, match="a tuple or list with one entry"):
        eqxs.filter_jit(_step, in_shardings=[r])


@pytest.mark.parametrize("variadic", [False, True])
def test_in_shardings_leaf_wrong_type_names_the_parameter(variadic):
    # As a shape error names `batch['w']`, so does a type error, beside its entry.
    _, r = _sharded()
    fun: Any = (lambda *xs: xs) if variadic else _step
    name = "xs[1]['w']" if variadic else "batch['w']"
    with _raises(TypeError, name, "in_shardings[1]['w']"):
        eqxs.filter_jit(fun, in_shardings=(r, {"w": "x"}))


def test_in_shardings_top_level_dict():
    # A dict is the form by parameter name: a key naming no parameter says so, and how
    # to give one argument a dict of shardings.
    _, r = _sharded()
    with _raises(ValueError, match=r"names 'w', which is not a parameter.*\(spec,\)"):
        eqxs.filter_jit(_step, in_shardings={"w": r})


@pytest.mark.parametrize("kind", ["in_shardings", "out_shardings"])
def test_shardings_leaf_wrong_type(kind):
    _, r = _sharded()
    with _raises(TypeError, _kp(kind, 1, "w")):
        kwargs: dict[str, Any] = {kind: (r, {"w": "x"})}
        eqxs.filter_jit(_step, **kwargs)


def test_in_shardings_leaf_is_a_mesh():
    with _raises(TypeError, _kp("in_shardings", 1)):
        eqxs.filter_jit(_step, in_shardings=(None, auto_mesh()))


def test_invalid_donate_mode():
    # A ValueError; or, under the test suite's runtime type-checking of the package,
    # a TypeError for the `Literal` annotation.
    with _raises((ValueError, TypeError), match="donate"):
        eqxs.filter_jit(_step, donate="yes")  # pyright: ignore[reportArgumentType]


#
# `filter_jit`: bad arguments, raised at call time, named by parameter.
#


def _args():
    model = {"w": jnp.arange(8.0), "b": jnp.ones((8, 2))}
    batch = [jnp.ones(16), jnp.arange(10.0)]
    return model, batch


def test_in_shardings_not_a_prefix_of_argument():
    s, r = _sharded()
    model, batch = _args()
    f = eqxs.filter_jit(_step, in_shardings=(r, (s, s)))
    with _raises(ValueError, "batch", inputs=(model, batch), match="in_shardings"):
        f(model, batch)


@pytest.mark.parametrize(
    "call",
    [
        lambda f, m, b: f(m, b),
        lambda f, m, b: f(m, batch=b),
        lambda f, m, b: f(batch=b, model=m),
    ],
    ids=["positional", "keyword", "all keywords"],
)
@pytest.mark.devices(8, reason="a dimension size that 8 devices do not divide")
def test_indivisible_argument(call):
    s, r = _sharded()
    model, batch = _args()
    f = eqxs.filter_jit(_step, in_shardings=(r, s))
    with _raises(ValueError, _kp("batch", 1), inputs=(model, batch)):
        call(f, model, batch)


@pytest.mark.devices(8, reason="a dimension size that 8 devices do not divide")
def test_indivisible_module_argument():
    s, _ = _sharded()
    model = make_module(eqx.nn.MLP, 4, 4, 6, 1)
    spec = jtu.tree_map(lambda _: s, model)
    f = eqxs.filter_jit(lambda model, x: model(x), in_shardings=(spec, None))
    path = _kp("model", ".layers", 0, ".weight")
    with _raises(ValueError, path, inputs=model):
        f(model, jnp.ones(4))


@pytest.mark.devices(8, reason="a dimension size that 8 devices do not divide")
def test_keyword_only_argument():
    s, _ = _sharded()
    f = eqxs.filter_jit(lambda x, *, key: x, in_shardings=s)
    x, key = jnp.arange(8.0), jnp.arange(3.0)
    with _raises(ValueError, "key", inputs=(x, key)):
        f(x, key=key)


@pytest.mark.devices(8, reason="a dimension size that 8 devices do not divide")
def test_var_keyword_argument():
    s, _ = _sharded()
    f = eqxs.filter_jit(lambda x, **extra: x, in_shardings=s)
    x, other = jnp.arange(8.0), {"y": jnp.arange(3.0)}
    with _raises(ValueError, _kp("other", "y"), inputs=(x, other)):
        f(x, other=other)


def test_var_positional_wrong_number():
    s, _ = _sharded()
    f = eqxs.filter_jit(lambda *args: args, in_shardings=(s, s))
    x = jnp.arange(8.0)
    with _raises(ValueError, inputs=x, match="2 entries.*1 positional"):
        f(x)


@pytest.mark.devices(8, reason="a dimension size that 8 devices do not divide")
def test_var_positional_indivisible():
    s, _ = _sharded()
    f = eqxs.filter_jit(lambda *args: args, in_shardings=(s, s))
    x, y = jnp.arange(8.0), jnp.arange(3.0)
    internal = tuple(n for n in _INTERNAL if n != "args[")
    with _raises(ValueError, "args[1]", inputs=(x, y), internal=internal):
        f(x, y)


def test_unknown_keyword_argument():
    s, _ = _sharded()
    f = eqxs.filter_jit(lambda x, y=1: x, in_shardings=(s, None))
    x = jnp.arange(8.0)
    with _raises(TypeError, inputs=x, match="'z'"):
        f(x, z=1)  # pyright: ignore[reportCallIssue]


@pytest.mark.devices(8, reason="a dimension size that 8 devices do not divide")
def test_method_self():
    s, _ = _sharded()

    class Scaled(eqx.Module):
        w: jax.Array

        @eqxs.filter_jit(in_shardings=(s, None))
        def __call__(self, x):
            return self.w * x

    model = Scaled(jnp.arange(10.0))
    x = jnp.arange(10.0)
    with _raises(ValueError, "self.w", inputs=(model, x)):
        model(x)


def test_bare_partition_spec_without_mesh_in_jit():
    model, batch = _args()
    f = eqxs.filter_jit(_step, in_shardings=(None, [P("x"), None]))
    with _raises(ValueError, _kp("batch", 0), inputs=(model, batch), match="set_mesh"):
        f(model, batch)


def test_rule_raises_in_jit():
    model, batch = _args()
    f = eqxs.filter_jit(_step, in_shardings=(None, _raising_rule))
    with _raises(ValueError, _kp("batch", 0), inputs=(model, batch)) as info:
        f(model, batch)
    assert isinstance(info.value.__cause__, _Boom)


def test_rule_returns_non_spec_in_jit():
    model, batch = _args()
    f = eqxs.filter_jit(_step, in_shardings=(None, lambda leaf: 3))
    with _raises(TypeError, _kp("batch", 0), inputs=(model, batch)):
        f(model, batch)


def test_scalar_with_partitioned_in_sharding():
    s, _ = _sharded()
    f = eqxs.filter_jit(_step, in_shardings=({"w": s, "step": s}, None))
    model = {"w": jnp.arange(8.0), "step": jnp.array(0)}
    with _raises(ValueError, _kp("model", "step"), inputs=model, match=r"P\(\)"):
        f(model, None)


def test_key_array_rank():
    mesh = auto_mesh()
    f = eqxs.filter_jit(_step, in_shardings=(NamedSharding(mesh, P("x", None)), None))
    keys = jr.split(jr.key(0), 8)
    with _raises(ValueError, "model", inputs=keys, match="rank 1"):
        f(keys, None)


@pytest.mark.parametrize("warm", ["first", "after a call", "after a lower"])
@pytest.mark.parametrize("method", ["lower", "eval_shape"])
@pytest.mark.devices(8, reason="a dimension size that 8 devices do not divide")
def test_lower_indivisible_struct(warm, method):
    s, _ = _sharded()
    f = eqxs.filter_jit(_step, in_shardings=(None, s))
    # The same static part: the entry that compiled the good shape is reused.
    if warm == "after a call":
        f(None, [jnp.arange(8.0)])
    elif warm == "after a lower":
        f.lower(None, [jax.ShapeDtypeStruct((8,), jnp.float32)])
    struct = jax.ShapeDtypeStruct((10,), jnp.float32)
    with _raises(ValueError, _kp("batch", 0)):
        getattr(f, method)(None, [struct])


#
# `filter_jit`: the same checks on every call, not only on the one that compiles (a
# call with new shapes reuses the entry of the first call).
#


class _Scaled(eqx.Module):
    w: jax.Array

    def __call__(self, batch):
        return self.w, batch + 1


@pytest.mark.parametrize("how", ["call", "method", "compiled", "disable_jit"])
@pytest.mark.parametrize(
    "shape, match", [((10, 2), "not divisible"), ((8,), "rank 1")], ids=["10", "rank"]
)
def test_bad_shape_after_a_good_call(how, shape, match):
    s, r = _sharded()
    if match == "not divisible" and s.mesh.size < 8:
        n, backend = jax.device_count(), jax.default_backend()
        why = "a dimension size that 8 devices do not divide"
        pytest.skip(f"needs 8 devices: {why}; {n} {backend} device(s) present")
    rows = NamedSharding(s.mesh, P("x", None))

    def fresh():
        return jax.device_put(jnp.arange(8.0), r)

    if how == "method":

        class Model(_Scaled):
            __call__ = eqxs.filter_jit(
                _Scaled.__call__, in_shardings=(r, rows), donate="all"
            )

        model = Model(fresh())
        model(jnp.ones((8, 2)))  # donates `model.w`
        model = Model(fresh())
        call, name = model, "batch"
    else:
        f = eqxs.filter_jit(_step, in_shardings=(r, rows), donate="all")
        if how == "compiled":
            f = f.lower(fresh(), jnp.ones((8, 2))).compile()
        else:
            f(fresh(), jnp.ones((8, 2)))
        model = fresh()
        call, name = ft.partial(f, model), "batch"
    bad = jnp.ones(shape)  # uncommitted: placed onto `rows` before the call
    with _raises(ValueError, name, inputs=(model, bad), match=match):
        if how == "disable_jit":
            with jax.disable_jit():
                call(bad)
        else:
            call(bad)


#
# `filter_jit`: committed inputs elsewhere are moved where `in_shardings` asks (a
# copy: the caller's arrays stay alive, unchanged and where they were).
#


def _moved(f, args, shardings):
    intact = _Intact(args)
    expected = jtu.tree_map(lambda a: a + 1, snapshot(args))
    # The first call, then cache hits: plain `jax.jit` takes the third call of an
    # array on another device order as placed (SIGSEGV on JAX 0.10.2).
    for _ in range(3):
        out = f(*args)
        assert_same_values(out, expected)
        arrays = [x for x in jtu.tree_leaves(out) if eqx.is_array(x)]
        for x, sharding in zip(arrays, shardings, strict=True):
            assert x.sharding.is_equivalent_to(sharding, x.ndim), (x, sharding)
        intact.check()


@pytest.mark.parametrize("donate", ["none", "all"])
@pytest.mark.devices(2, reason="P('x') and P() are the same sharding on one device")
def test_committed_with_other_sharding(donate):
    s, r = _sharded()
    f = eqxs.filter_jit(_step, in_shardings=({"w": s, "b": None}, None), donate=donate)
    model = {"w": jax.device_put(jnp.arange(8.0), r), "b": 1}
    _moved(f, (model, 2), [s])


@pytest.mark.parametrize("donate", ["none", "all"])
@pytest.mark.parametrize("where", ["other mesh", "one device", "device order"])
@pytest.mark.devices(8, reason="arrays on some of 8 devices, or in another order")
def test_committed_outside_target_devices(where, donate):
    s, _ = _sharded()
    if where == "other mesh":
        half = jax.sharding.Mesh(np.array(jax.devices()[4:]), ("x",))
        placed = jax.device_put(jnp.arange(8.0), NamedSharding(half, P("x")))
    elif where == "one device":
        placed = jax.device_put(jnp.arange(8.0), nth_device(5))
    else:
        reverse = jax.sharding.Mesh(np.array(jax.devices()[::-1]), ("x",))
        placed = jax.device_put(jnp.arange(8.0), NamedSharding(reverse, P("x")))
    f = eqxs.filter_jit(_step, in_shardings=({"w": s, "b": None}, None), donate=donate)
    _moved(f, ({"w": placed, "b": 1}, 2), [s])  # `b` and `2` are static


def test_committed_to_one_device_replicated_and_donated():
    # As plain `jax.jit`: its replicated copy shares the buffer on device 0, so
    # donating the copy deletes the caller's array (donation frees its memory).
    _, r = _sharded()
    f = eqxs.filter_jit(_step, in_shardings=(r, None), donate="all")
    model = jax.device_put(jnp.arange(8.0), jax.devices()[0])
    expected = snapshot(model) + 1
    out, _ = f(model, None)
    assert_same_values(out, expected)
    assert out.sharding.is_equivalent_to(r, 1)
    assert model.is_deleted()
    with pytest.raises(RuntimeError, match="has been deleted"):
        f(model, None)


@pytest.mark.cpu(reason="memory kinds other than device behave otherwise on a chip")
def test_committed_with_other_memory_kind():
    mesh = auto_mesh()
    pinned = NamedSharding(mesh, P("x"), memory_kind="pinned_host")
    f = eqxs.filter_jit(lambda x: x, in_shardings=pinned, out_shardings=pinned)
    x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("x")))
    intact = _Intact(x)
    out = f(x)
    assert out.sharding.memory_kind == "pinned_host"
    assert_same_values(out, snapshot(x))
    intact.check()


@pytest.mark.devices(2, reason="an array committed to another device")
@pytest.mark.parametrize("donate", ["none", "all"])
def test_committed_on_other_devices_unspecified(donate):
    s, _ = _sharded()
    f = eqxs.filter_jit(_step, in_shardings=(s, None), donate=donate)
    model = jax.device_put(jnp.arange(8.0), s)
    batch = {"q": jax.device_put(jnp.arange(8.0), nth_device(5))}
    with _raises(ValueError, "model", _kp("batch", "q"), inputs=(model, batch)):
        f(model, batch)


@pytest.mark.devices(8)
def test_in_shardings_from_two_device_sets():
    devices = np.array(jax.devices())
    first = NamedSharding(jax.sharding.Mesh(devices, ("x",)), P("x"))
    second = NamedSharding(jax.sharding.Mesh(devices[4:], ("x",)), P("x"))
    f = eqxs.filter_jit(_step, in_shardings=({"w": first, "b": second}, None))
    model = {"w": jnp.arange(8.0), "b": jnp.arange(8.0)}
    with _raises(ValueError, _kp("model", "w"), _kp("model", "b"), inputs=model):
        f(model, None)


@pytest.mark.devices(2, reason="an array committed to another device")
def test_committed_elsewhere_donates_the_copy():
    # The first argument is in place and donated; the second is committed elsewhere:
    # its copy is donated, and the caller's array stays alive.
    s, r = _sharded()
    f = eqxs.filter_jit(_step, in_shardings=(s, s), donate="all")
    model = jax.device_put(jnp.arange(8.0), s)
    batch = jax.device_put(jnp.arange(8.0), r)
    intact = _Intact(batch)
    out = f(model, batch)
    expected = np.arange(8.0, dtype=np.float32) + 1
    assert_same_values(out, (expected, expected))
    assert model.is_deleted()  # donated, as asked
    intact.check()


#
# `filter_jit`: `out_shardings` that do not fit the output (raised whilst tracing,
# before anything runs: donated inputs survive).
#


@pytest.mark.parametrize(
    "out_shardings, path, match",
    [
        (({"w": "replicated"}, None), _kp("out", 0, "b"), None),
        ([None, None], "out", "list.*tuple"),
        (({"w": "rank", "b": None}, None), _kp("out", 0, "w"), "rank 1"),
        ((None, [None, "split"]), _kp("out", 1, 1), "10"),
    ],
    ids=["not a prefix", "list for tuple", "rank", "indivisible"],
)
def test_out_shardings_do_not_fit(out_shardings, path, match):
    s, r = _sharded()
    leaves = {
        "replicated": r,
        "rank": NamedSharding(auto_mesh(), P("x", None)),
        "split": s,
        "mixed": NamedSharding(mixed_mesh(), P(("data", "model"))),
    }
    out_shardings = jtu.tree_map(lambda x: leaves[x], out_shardings)
    model, batch = _args()
    model = jax.device_put(model, r)
    f = eqxs.filter_jit(_step, out_shardings=out_shardings, donate="all")
    with _raises(ValueError, path, inputs=(model, batch), match=match):
        f(model, batch)


@pytest.mark.xfail(
    strict=True,
    reason="`out_shardings` on other devices than the inputs: JAX's 'Received "
    "incompatible devices for jitted computation. Got argument model of _step ... and "
    "explicit output sharding with device ids [4, 5, 6, 7]' names the argument but not "
    "the output's key path",
)
def test_out_shardings_on_other_devices():
    s, _ = _sharded()
    half = NamedSharding(jax.sharding.Mesh(np.array(jax.devices()[4:]), ("x",)), P())
    f = eqxs.filter_jit(_step, in_shardings=(s, None), out_shardings=(None, half))
    model, batch = jnp.arange(8.0), jnp.arange(8.0)
    with _raises(ValueError, _kp("out", 1), inputs=(model, batch)):
        f(model, batch)


#
# `filter_jit`: deleted and donated inputs.
#


@pytest.mark.parametrize("warm", [False, True], ids=["first call", "cached"])
@pytest.mark.parametrize("donate", ["none", "all"])
def test_deleted_input(warm, donate):
    s, _ = _sharded()
    f = eqxs.filter_jit(_step, in_shardings=(s, None), donate=donate)
    if warm:
        f({"w": jax.device_put(jnp.arange(8.0), s)}, [jnp.zeros(8)])
    deleted = jax.device_put(jnp.arange(8.0), s)
    deleted.delete()
    batch = [jnp.zeros(8)]
    with _raises(
        RuntimeError, _kp("model", "w"), inputs=batch, match="deleted"
    ) as info:
        f({"w": deleted}, batch)
    # Said once: not after another error (one from a launch's own look, or JAX's).
    assert info.value.__suppress_context__ or info.value.__context__ is None


@pytest.mark.parametrize("warm", [False, True], ids=["first call", "cached"])
@pytest.mark.parametrize("donate", ["none", "all"])
@pytest.mark.parametrize("committed", [True, False])
@pytest.mark.parametrize("gone", ["deleted", "donated"])
def test_deleted_input_on_one_device(warm, donate, committed, gone, capfd):
    # Where `jax.jit` (or a donating launch) finds it first, the error still names it,
    # and XLA says nothing (JAX 0.10.2 logs an uncommitted donated one at Execute).
    s = NamedSharding(jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",)), P())
    f = eqxs.filter_jit(_step, in_shardings=s, donate=donate)
    if warm:
        f({"w": jax.device_put(jnp.arange(8.0), s)}, [jnp.zeros(8)])
    deleted = jax.device_put(jnp.arange(8.0), s) if committed else jnp.arange(8.0)
    if gone == "deleted":
        deleted.delete()
    else:
        eqxs.filter_jit(lambda x: x + 1, in_shardings=s, donate="all")(deleted)
    batch = [jax.device_put(jnp.zeros(8), s) if committed else jnp.zeros(8)]
    capfd.readouterr()
    with _raises(
        RuntimeError, _kp("model", "w"), inputs=batch, match="deleted"
    ) as info:
        f({"w": deleted}, batch)
    # Said once: not after another error (one from a launch's own look, or JAX's).
    assert info.value.__suppress_context__ or info.value.__context__ is None
    assert capfd.readouterr().err == ""


@pytest.mark.parametrize("devices", [1, 8])
@pytest.mark.parametrize("warm", [False, True], ids=["first call", "cached"])
@pytest.mark.parametrize("bad", [np.array(["a", "b"]), np.array([None, 1])])
def test_numpy_leaf_of_no_jax_type_is_named(devices, warm, bad):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]), ("x",))
    f = eqxs.filter_jit(_step, in_shardings=NamedSharding(mesh, P()))
    batch = [jnp.zeros(8)]
    if warm:  # an entry for these shapes, with a number there
        f({"w": np.zeros(2, np.float32)}, batch)
    with _raises(TypeError, _kp("model", "w"), inputs=batch, match="valid JAX"):
        f({"w": bad}, batch)


def test_deleted_input_donated_and_passed_again():
    f = eqxs.filter_jit(_step, donate="all-except-first")
    deleted = jnp.arange(8.0)
    deleted.delete()
    with _raises(RuntimeError, _kp("model"), match="deleted"):
        f(deleted, deleted)


# Passing an array that an earlier call *donated* (rather than one deleted with
# `.delete()`) to a function that has run before crashes the process (SIGSEGV, JAX
# 0.10.2, CPU, an array sharded over several devices): JAX's C++ dispatch path does not
# notice that it is gone. So these run in a separate process.
_REUSE_DONATED = """
import equinox_shard as eqxs
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
s = NamedSharding(mesh, P("x"))

def step(model, batch):
    return model + batch

def fresh():
    return jax.device_put(jnp.arange(8.0), s)

donating = eqxs.filter_jit(step, donate="all")
other = eqxs.filter_jit(step, donate={donate!r})
other(fresh(), fresh())  # Runs once: JAX's fast path is warm.
model = fresh()
donating(model, fresh())
assert model.is_deleted()
try:
    other(model, fresh())
except Exception as e:
    report({{"type": type(e).__name__, "message": str(e)}})
else:
    report(None)
"""


@pytest.mark.parametrize(
    "donate",
    [
        "all",
        "none",
    ],
)
def test_reuse_of_donated_input_does_not_crash(donate):
    run = run_isolated(_REUSE_DONATED.format(donate=donate), timeout=120)
    assert run.returncode == 0, run
    assert run.result is not None, run
    assert run.result["type"] == "RuntimeError", run
    assert _names(run.result["message"], "model"), run
    assert "deleted" in run.result["message"], run


@pytest.mark.parametrize("committed", [True, False])
def test_same_buffer_donated_twice(committed):
    # Tied weights: one array reachable twice in the donated arguments. `jax.jit` and
    # `eqx.filter_jit` raise XLA's INVALID_ARGUMENT (or crash, over several devices);
    # we raise, naming both, before anything runs.
    s, _ = _sharded()
    f = eqxs.filter_jit(_step, donate="all")
    tied = jnp.arange(8.0)
    tied = jax.device_put(tied, s) if committed else tied
    batch = jax.device_put(jnp.ones(8), s)
    model = {"encoder": tied, "decoder": tied}
    paths = ("model['decoder']", "model['encoder']")
    with _raises(ValueError, *paths, inputs=(model, batch), match="donated once"):
        f(model, batch)
    with _raises(ValueError, "x", "y", inputs=batch, match="donated once"):
        eqxs.filter_jit(lambda x, y: x + y, donate="all")(batch, batch)


class _Tied(eqx.Module):
    w: jax.Array
    v: jax.Array

    def __call__(self, x):
        return self.w + self.v + x


def test_same_buffer_donated_twice_in_function():
    s, _ = _sharded()
    w = jax.device_put(jnp.arange(8.0), s)
    f = eqxs.filter_jit(_Tied(w, w), donate="all-except-first")
    with _raises(ValueError, "fun.w", "fun.v", inputs=w, match="donated once"):
        f(jnp.ones(8))


@pytest.mark.parametrize("donate", ["all-except-first", "warn-except-first"])
def test_donated_and_kept_buffer(donate):
    # The same array in the kept first argument and in a donated one: it must not be
    # deleted, since the caller still holds it as the first argument.
    s, _ = _sharded()
    f = eqxs.filter_jit(_step, donate=donate)
    shared = jax.device_put(jnp.arange(8.0), s)
    other = jax.device_put(jnp.ones(8), s)
    expected = snapshot(shared)
    out = f(shared, [shared, other])
    assert not shared.is_deleted()
    np.testing.assert_array_equal(shared, expected)
    np.testing.assert_array_equal(out[1][0], np.arange(8.0) + 1)


class _Affine(eqx.Module):
    w: jax.Array

    def __call__(self, x):
        return self.w + x


def test_donated_array_also_in_function():
    s, _ = _sharded()
    w = jax.device_put(jnp.arange(8.0), s)
    f = eqxs.filter_jit(_Affine(w), donate="all")
    with _raises(ValueError, "x", inputs=w, match="donated"):
        f(w)


@pytest.mark.parametrize("donate", ["none", "all-except-first"])
def test_deleted_array_of_function(donate):
    s, _ = _sharded()
    w = jax.device_put(jnp.arange(8.0), s)
    f = eqxs.filter_jit(_Affine(w), donate=donate)
    np.testing.assert_array_equal(f(jnp.ones(8)), np.arange(8.0) + 1)
    if donate == "none":
        w.delete()
    # Else the call donated it: the one donated input (`x`, first, is kept).
    assert w.is_deleted()
    x = jax.device_put(jnp.ones(8), s)
    with _raises(RuntimeError, "fun.w", inputs=x, match="deleted"):
        f(x)


_FUNCTION_ARRAY_DONATED_ELSEWHERE = """
import equinox as eqx
import equinox_shard as eqxs
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
s = NamedSharding(mesh, P("x"))

class Affine(eqx.Module):
    w: jax.Array

    def __call__(self, x):
        return self.w + x

w = jax.device_put(jnp.arange(8.0), s)
f = eqxs.filter_jit(Affine(w))
f(jnp.ones(8))  # Runs once: JAX's fast path is warm.
jax.jit(lambda a: a * 2, donate_argnums=0)(w)
assert w.is_deleted()
try:
    f(jnp.ones(8))
except Exception as e:
    report({"type": type(e).__name__, "message": str(e)})
else:
    report(None)
"""


@pytest.mark.xfail(
    jax.__version_info__ < (0, 12),
    strict=True,
    reason="An array of a Module used as the function, donated to another call, "
    "crashes JAX 0.10.2's dispatch (SIGSEGV) when the function does not donate: its "
    "arrays are checked only under donation, as checking them on every call would add "
    "a flatten of the function to the fast path. JAX 0.12 raises, and we name it.",
)
def test_function_array_donated_elsewhere_does_not_crash():
    run = run_isolated(_FUNCTION_ARRAY_DONATED_ELSEWHERE, timeout=120)
    assert run.returncode == 0, run
    assert run.result is not None, run
    assert run.result["type"] == "RuntimeError", run
    assert _names(run.result["message"], "fun.w"), run


@pytest.mark.devices(8, reason="a dimension size that 8 devices do not divide")
def test_var_positional_named_by_its_parameter():
    # `*xs` names its leaves `xs[k]`, counted from the first variadic argument.
    def f(n, *xs):
        return xs

    d = jnp.arange(3.0)
    d.delete()
    with pytest.raises(RuntimeError, match=r"^xs\[1\]: this array has been deleted"):
        eqxs.filter_jit(f)(1, jnp.arange(2.0), d)
    s, _ = _sharded()
    g = eqxs.filter_jit(f, in_shardings=(None, s, s))
    with pytest.raises(ValueError, match=r"xs\[1\]"):
        g(1, jnp.arange(8.0), jnp.arange(3.0))
