"""The kinds of spec leaf (`equinox_shard._spec.kinds`): a kind is its row of the table,
its resolution and its eager placement included, so that a new kind is read by every
public function without any other module naming it."""

import inspect
import re

import equinox as eqx
import equinox_shard as eqxs
import equinox_shard._spec.kinds as kinds_module
import jax
import jax.numpy as jnp
import pytest
from jax.experimental.layout import Format, Layout
from jax.sharding import make_single_device_sharding, NamedSharding, PartitionSpec as P

from .helpers import assert_alive, assert_same_values, auto_mesh, snapshot


class OnDevice:
    """A toy kind that needs resolving: the `index`-th of `jax.devices()`."""

    def __init__(self, index: int):
        self.index = index

    def __repr__(self):
        return f"OnDevice({self.index})"


def _layout_target(leaf, layout, where):
    if leaf.ndim != len(layout.major_to_minor):
        raise ValueError(f"{where()}: the toy layout {layout} has another rank.")
    return Format(layout, leaf.sharding)


@pytest.fixture
def toy_kinds(monkeypatch):
    """The table with two more rows: `OnDevice`, resolved to a `SingleDeviceSharding`,
    and a bare `Layout`, placed eagerly as the array's own sharding in that layout."""
    rows = (
        kinds_module.Kind(
            OnDevice,
            "`OnDevice`",
            resolve=lambda x, mesh, where: make_single_device_sharding(
                jax.devices()[x.index]
            ),
        ),
        kinds_module.Kind(
            Layout,
            "`Layout`",
            sharding=lambda x: None,
            target=_layout_target,
            placement_only=True,
            placement_hint="the toy hint",
            in_trace=kinds_module.InTrace.REFUSED,
            in_trace_hint="the toy hint",
            jit_in_refused=True,
            jit_in_hint="the toy hint",
        ),
    )
    table = kinds_module.KINDS + rows
    monkeypatch.setattr(kinds_module, "KINDS", table)
    monkeypatch.setattr(kinds_module, "_BY_TYPE", {k.type: k for k in table})
    monkeypatch.setattr(kinds_module, "TYPES", tuple(k.type for k in table))


def test_a_new_kind_is_its_row(toy_kinds):
    device = jax.devices()[3]
    s = NamedSharding(auto_mesh(), P("x"))
    x = jnp.arange(32.0).reshape(8, 4)
    y = jax.device_put(jnp.arange(64.0).reshape(8, 8), s)
    tree = {"a": x, "b": y, "n": 1}
    expected = snapshot(tree)
    spec = {"a": OnDevice(3), "b": Layout((1, 0)), "n": None}
    for place in (eqxs.filter_device_put, eqxs.filter_shard):
        out = place(tree, spec)
        # The oracle: `jax.device_put` onto what each row gives.
        assert out["a"].sharding == jax.device_put(x, device).sharding
        assert out["a"].committed
        assert out["b"].format == jax.device_put(y, Format(Layout((1, 0)), s)).format
        assert out["b"].format.layout.major_to_minor == (1, 0)
        assert_same_values(out, expected)
        assert_alive(tree)
        # Already placed, by the rows' own tests: the same objects.
        again = place(out, spec)
        assert again["a"] is out["a"] and again["b"] is out["b"]
    with pytest.raises(ValueError, match=r"x\['b'\]: the toy layout"):
        eqxs.filter_device_put({"b": x[0]}, {"b": spec["b"]})
    # `filter_jit`'s `in_shardings` resolve it as every other function does.
    f = eqxs.filter_jit(lambda a: a * 2, in_shardings=OnDevice(3))
    out = f(x)
    assert out.sharding == make_single_device_sharding(device)
    assert_same_values(out, expected["a"] * 2)
    # The rows' refusals, with their hints, naming the leaf.
    with pytest.raises(TypeError, match=r"x\['b'\]: inside a trace.*the toy hint"):
        eqx.filter_jit(lambda t: eqxs.filter_shard(t, spec))(tree)
    with pytest.raises(TypeError, match=r"\['b'\]: `in_shardings` cannot hold"):
        eqxs.filter_jit(lambda t: t, in_shardings=(spec,))(tree)


# The public names that take a spec tree: each docstring lists the kinds for its users,
# so a row of the table without its line there fails here (derived, not copied).
@pytest.mark.parametrize(
    "public", ["filter_device_put", "filter_shard", "filter_jit", "PathRules"]
)
def test_each_docstring_names_every_kind_of_the_table(public):
    doc = inspect.getdoc(getattr(eqxs, public)) or ""
    names = [re.search(r"`([^`]+)`", kind.name) for kind in kinds_module.KINDS]
    missing = [n.group(1) for n in names if n is not None and n.group(1) not in doc]
    assert len(names) == len(kinds_module.KINDS) >= 5 and missing == [], (
        f"`{public}`'s docstring does not name the spec-leaf kinds {missing}"
    )
