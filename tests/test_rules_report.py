import re

import equinox as eqx
import equinox_shard as eqxs
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from .helpers import auto_mesh, grid_shape, make_module


class Net(eqx.Module):
    attention: eqx.nn.MultiheadAttention
    mlp: eqx.nn.MLP

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.attention = eqx.nn.MultiheadAttention(2, 8, key=k1)
        self.mlp = eqx.nn.MLP(8, 4, 16, 1, key=k2)


MISSPELT = r"atention\.output_proj\.weight$"  # the `t` of `attention` is missing


def _rules(**kwargs) -> eqxs.PathRules:
    return eqxs.PathRules(
        [
            (r"attention\.(query|key|value)_proj\.weight$", P("model", None)),
            (MISSPELT, P(None, "model")),
            (r"mlp\.layers\[0\]\.weight$", P("model", None)),
        ],
        default=P(),
        **kwargs,
    )


def _mesh():
    return auto_mesh(grid_shape(), ("data", "model"))


def _laid_out(x, mesh, spec) -> bool:
    # Equivalence, not the spec's names: on one device every spec lays `x` out alike,
    # and `jax.jit` may name its output's either way.
    return x.sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim)


def _net() -> Net:
    return make_module(lambda key: Net(key))


def _adam(net: Net):
    return optax.adam(1e-3).init(eqx.filter(net, eqx.is_array))


def _array_paths(tree, name="") -> list[str]:
    return [
        name + jtu.keystr(path)
        for path, x in jtu.tree_flatten_with_path(tree)[0]
        if eqx.is_array(x)
    ]


#
# The report.
#


def test_misspelt_pattern_is_unused_and_its_leaf_falls_to_the_default():
    net = _net()
    opt_state = _adam(net)
    rules = _rules()
    report = eqxs.explain_rules((net, opt_state), rules)
    assert report.unused == (eqxs.RuleMatch(1, MISSPELT, P(None, "model")),)
    assert report.overlaps == {}
    assert report.unmatched == ()
    default = eqxs.RuleMatch(None, "default", P())
    qkv = eqxs.RuleMatch(0, rules.rules[0][0], P("model", None))
    mlp = eqxs.RuleMatch(2, rules.rules[2][0], P("model", None))
    # The weight the misspelt rule was written for is replicated by the default...
    assert report.placed["[0].attention.output_proj.weight"] == default
    assert report.placed["[1][0].mu.attention.output_proj.weight"] == default
    # ...and so it is, really.
    with jax.set_mesh(_mesh()):
        placed, _ = eqxs.filter_device_put((net, opt_state), rules)
    assert placed.attention.output_proj.weight.sharding.spec == P()
    assert report.placed["[0].attention.query_proj.weight"] == qkv
    assert report.placed["[1][0].nu.attention.value_proj.weight"] == qkv
    assert report.placed["[0].mlp.layers[0].weight"] == mlp
    assert report.placed["[1][0].count"] == default
    # One entry per array leaf: the activation function and Adam's `EmptyState`
    # are not arrays.
    assert list(report.placed) == _array_paths((net, opt_state))
    assert report.placed["[0].mlp.layers[1].bias"].index is None
    assert (
        report.placed["[0].mlp.layers[0].weight"].pattern
        == r"mlp\.layers\[0\]\.weight$"
    )


def test_report_agrees_with_the_placement():
    net = _net()
    rules = _rules()
    report = eqxs.explain_rules(net, rules, name="net")
    mesh = _mesh()
    with jax.set_mesh(mesh):
        placed = eqxs.filter_device_put(net, rules)
    specs = {
        "net" + jtu.keystr(p): x.sharding.spec
        for p, x in jtu.tree_flatten_with_path(placed)[0]
        if eqx.is_array(x)
    }
    assert {k: v.spec for k, v in report.placed.items()} == specs
    assert specs["net.attention.key_proj.weight"] == P("model", None)


def test_overlaps_first_match_wins():
    net = _net()
    general = (r"weight$", P("data", None))
    specific = (r"layers\[0\]\.weight$", P("model", None))
    never = (r"query_proj\.weight$", P(None, "model"))
    rules = eqxs.PathRules([general, specific, never], default=P())
    report = eqxs.explain_rules(net.mlp, rules)
    won = eqxs.RuleMatch(0, *general)
    assert report.overlaps == {
        ".layers[0].weight": eqxs.RuleOverlap(won, (eqxs.RuleMatch(1, *specific),))
    }
    assert report.placed[".layers[0].weight"] == won
    assert report.placed[".layers[1].weight"] == won
    # Rule 1 matched (and lost): not unused. Rule 2 matched nothing here.
    assert report.unused == (eqxs.RuleMatch(2, *never),)
    with jax.set_mesh(_mesh()):
        placed = eqxs.filter_device_put(net.mlp, rules)
    assert placed.layers[0].weight.sharding.spec == P("data", None)

    # Across the whole model, rule 2 is shadowed by rule 0 on the query projection.
    report = eqxs.explain_rules(net, rules)
    assert report.unused == ()
    assert report.overlaps[".attention.query_proj.weight"] == eqxs.RuleOverlap(
        won, (eqxs.RuleMatch(2, *never),)
    )
    assert sorted(report.overlaps) == [
        ".attention.query_proj.weight",
        ".mlp.layers[0].weight",
    ]


def test_no_rule_and_no_default_is_reported_not_raised():
    net = _net()
    rules = eqxs.PathRules([(r"weight$", P())])
    report = eqxs.explain_rules(net.mlp, rules, name="mlp")
    assert report.unmatched == ("mlp.layers[0].bias", "mlp.layers[1].bias")
    assert list(report.placed) == ["mlp.layers[0].weight", "mlp.layers[1].weight"]
    with pytest.raises(ValueError, match=re.escape("x.layers[0].bias: no rule")):
        eqxs.filter_device_put(net.mlp, rules)


def test_leaves_under_other_spec_leaves_are_not_reported():
    net = _net()
    batch = {"x": np.zeros((8, 8), np.float32)}
    rules = _rules()
    report = eqxs.explain_rules((net, batch), (rules, P("data")))
    assert all(path.startswith("[0]") for path in report.placed)
    assert len(report.placed) == len(_array_paths(net))
    # Rules whose specification holds no `PathRules` report nothing.
    empty = eqxs.explain_rules(net, P())
    assert (empty.placed, empty.unused, empty.overlaps) == ({}, (), {})


def test_shape_dtype_structs_are_reported():
    # A plan: `eqx.filter_eval_shape` gives `jax.ShapeDtypeStruct`s, not arrays.
    shapes = eqx.filter_eval_shape(Net, jax.random.key(0))
    report = eqxs.explain_rules(shapes, _rules())
    assert report.placed[".mlp.layers[0].weight"].index == 2
    assert report.unused == (eqxs.RuleMatch(1, MISSPELT, P(None, "model")),)


#
# "Unused" across one call.
#


def test_unused_means_in_no_subtree_of_the_call():
    net = _net()
    opt_state = _adam(net)
    batch = (np.zeros((8, 8), np.float32), np.zeros((8,), np.int32))
    model_rules = eqxs.PathRules([(r"weight$", P("model", None))], default=P())
    batch_rules = eqxs.PathRules([(r"^\[0\]$", P("data", None))], default=P("data"))
    # Applied to the batch alone, the model's rule matches nothing...
    alone = eqxs.explain_rules(batch, model_rules)
    assert alone.unused == (eqxs.RuleMatch(0, r"weight$", P("model", None)),)
    # ...but applied to the model too in the same call it is used.
    specs = (model_rules, model_rules, batch_rules)
    report = eqxs.explain_rules((net, opt_state, batch), specs)
    assert report.unused == ()
    assert report.placed["[2][0]"] == eqxs.RuleMatch(0, r"^\[0\]$", P("data", None))
    assert report.placed["[2][1]"] == eqxs.RuleMatch(None, "default", P("data"))
    # Equal rules are one: two copies of the model's rules are used if either is.
    copy = eqxs.PathRules([(r"weight$", P("model", None))], default=P())
    report = eqxs.explain_rules((net, batch), (model_rules, copy))
    assert report.unused == ()
    # A rule set that matches in no subtree is reported once.
    report = eqxs.explain_rules((batch, batch), (model_rules, model_rules))
    assert report.unused == (eqxs.RuleMatch(0, r"weight$", P("model", None)),)


def test_strict_rules_over_every_argument_of_filter_jit():
    net = _net()
    opt_state = _adam(net)
    batch = np.zeros((8, 8), np.float32)
    rules = eqxs.PathRules(
        [
            (r"attention\.(query|key|value)_proj\.weight$", P("model", None)),
            (r"attention\.output_proj\.weight$", P(None, "model")),
        ],
        default=P(),
        strict=True,
    )
    traced = []

    def step(model, opt_state, x):
        traced.append(1)
        return model, opt_state, x.sum()

    mesh = _mesh()
    with jax.set_mesh(mesh):
        # One `PathRules` over every argument: the batch matches none of its rules,
        # and that is fine, as the model matches each.
        out, _, _ = eqxs.filter_jit(step, in_shardings=rules)(net, opt_state, batch)
        assert _laid_out(out.attention.output_proj.weight, mesh, P(None, "model"))
        # The tuple form, the same rules for the model and the optimiser state.
        f = eqxs.filter_jit(step, in_shardings=(rules, rules, P("data")))
        out, state, _ = f(net, opt_state, batch)
        assert _laid_out(state[0].mu.attention.query_proj.weight, mesh, P("model"))
    assert len(traced) == 2


#
# Strict rules.
#


def _strict_message(path_prefix: str) -> list[str]:
    return [
        repr(MISSPELT),
        "matched no key path",
        f"{path_prefix}attention.output_proj.weight",
    ]


def _assert_names(error: pytest.ExceptionInfo, parts: list[str]):
    message = str(error.value)
    for part in parts:
        assert part in message, (part, message)


def test_strict_filter_device_put():
    net = _net()
    with jax.set_mesh(_mesh()), pytest.raises(ValueError) as error:
        eqxs.filter_device_put(net, _rules(strict=True))
    _assert_names(error, ["strict", *_strict_message("x.")])


def test_strict_filter_shard_eager_and_traced():
    net = _net()
    rules = _rules(strict=True)
    with jax.set_mesh(_mesh()):
        with pytest.raises(ValueError) as error:
            eqxs.filter_shard(net, rules)
        _assert_names(error, _strict_message("x."))
        with pytest.raises(ValueError) as error:
            eqx.filter_jit(lambda m: eqxs.filter_shard(m, rules))(net)
        _assert_names(error, _strict_message("x."))


def test_strict_filter_jit_in_shardings_before_tracing():
    net = _net()
    opt_state = _adam(net)
    traced = []

    def step(model, opt_state, x):
        traced.append(1)
        return x

    rules = _rules(strict=True)
    f = eqxs.filter_jit(step, in_shardings=(rules, rules, P("data")))
    with jax.set_mesh(_mesh()), pytest.raises(ValueError) as error:
        f(net, opt_state, np.zeros(8, np.float32))
    # Named as the user's arguments, across both: the unused rule is searched in the
    # model and in the optimiser state.
    _assert_names(error, [*_strict_message("model."), "in_shardings[0]"])
    assert traced == []


def test_strict_filter_jit_checked_once_per_layout(monkeypatch):
    net = _net()
    calls = []
    search = eqxs.PathRules.matches

    def counting(self, path):
        calls.append(path)
        return search(self, path)

    monkeypatch.setattr(eqxs.PathRules, "matches", counting)
    rules = eqxs.PathRules([(r"weight$", P("model", None))], default=P(), strict=True)
    f = eqxs.filter_jit(lambda model: model, in_shardings=rules)
    with jax.set_mesh(_mesh()):
        f(net)
        first = len(calls)
        f(net)
        f(net)
    assert first == len(_array_paths(net))
    assert len(calls) == first  # the cached calls search no pattern


def test_strict_filter_jit_out_shardings():
    net = _net()
    f = eqxs.filter_jit(lambda model: model, out_shardings=_rules(strict=True))
    with jax.set_mesh(_mesh()), pytest.raises(ValueError) as error:
        f(net)
    _assert_names(error, _strict_message("out."))


def test_strict_filter_shard_map():
    net = _net()
    mesh = _mesh()
    rules = eqxs.PathRules(
        [
            (r"(query|key|value)_proj\.weight$", P("model")),
            (MISSPELT, P("model")),
        ],
        default=P(),
        strict=True,
    )
    batch = np.zeros((8, 8), np.float32)
    f = eqxs.filter_shard_map(
        lambda m, x: x.sum(), mesh=mesh, in_specs=(rules, P("data")), out_specs=P()
    )
    with pytest.raises(ValueError) as error:
        f(net, batch)
    _assert_names(error, _strict_message("args[0]."))
    # Over the model and the batch at once, the batch matching nothing is fine.
    fixed = eqxs.PathRules(
        [(r"(query|key|value)_proj\.weight$", P("model"))], default=P(), strict=True
    )
    g = eqxs.filter_shard_map(
        lambda m, x: jax.lax.psum(x.sum(), ("data", "model")),
        mesh=mesh,
        in_specs=(fixed, fixed),
        out_specs=P(),
    )
    assert float(g(net, jnp.ones((8, 8), jnp.float32))) == mesh.size * 64


def test_strict_overlap_names_winner_and_loser():
    net = _net()
    rules = eqxs.PathRules(
        [
            (r"weight$", P("model", None)),
            (r"layers\[0\]\.weight$", P(None, "model")),
        ],
        default=P(),
        strict=True,
    )
    with jax.set_mesh(_mesh()), pytest.raises(ValueError) as error:
        eqxs.filter_device_put(net, rules)
    _assert_names(
        error,
        [
            "x.mlp.layers[0].weight",
            "rule 0 'weight$'",
            "rule 1 'layers\\\\[0\\\\]\\\\.weight$'",
            "first match wins",
        ],
    )
    assert "unused" not in str(error.value)


@pytest.mark.parametrize(
    "keys, names, them", [("a", "x['a']", "it"), ("ab", "x['a'], x['b']", "them")]
)
def test_strict_overlap_says_which_rule_places_it_or_them(keys, names, them):
    rules = eqxs.PathRules([(r"a|b", P()), (r"[ab]", P())], default=P(), strict=True)
    with jax.set_mesh(_mesh()), pytest.raises(ValueError) as error:
        eqxs.filter_device_put({k: np.zeros(8, np.float32) for k in keys}, rules)
    assert str(error.value).splitlines()[1] == (
        f"- rule 0 'a|b' and rule 1 '[ab]' both match {names}; rule 0 'a|b' places "
        f"{them} (first match wins)."
    )


def test_strict_false_is_unchanged():
    net = _net()
    mesh = _mesh()
    loose = _rules()
    with jax.set_mesh(mesh):
        out = eqxs.filter_device_put(net, loose)
        traced = eqxs.filter_jit(lambda m: m, in_shardings=loose)(net)
    for placed in (out, traced):
        assert _laid_out(placed.attention.query_proj.weight, mesh, P("model", None))
        assert _laid_out(placed.attention.output_proj.weight, mesh, P())
        assert _laid_out(placed.mlp.layers[1].weight, mesh, P())


def test_strict_is_part_of_equality():
    loose, strict = _rules(), _rules(strict=True)
    assert loose != strict
    assert strict == _rules(strict=True) and hash(strict) == hash(_rules(strict=True))
    assert not loose.strict and strict.strict
    assert repr(strict).endswith(f"default={P()!r}, strict=True)")
    assert repr(loose).endswith(f"default={P()!r})")
    net = _net()
    # `filter_jit` caches on its `in_shardings`: the strict rules must not reuse the
    # loose rules' checked layout.
    with jax.set_mesh(_mesh()):
        eqxs.filter_jit(lambda m: m, in_shardings=loose)(net)
        with pytest.raises(ValueError, match="matched no key path"):
            eqxs.filter_jit(lambda m: m, in_shardings=strict)(net)


def test_strict_report_is_not_needed_to_explain():
    # `explain_rules` never raises for a strict `PathRules`: it reports.
    report = eqxs.explain_rules(_net(), _rules(strict=True))
    assert [m.index for m in report.unused] == [1]


#
# `sharding_table(..., rules=...)`.
#


def test_sharding_table_rule_column_and_notes():
    net = _net()
    rules = eqxs.PathRules(
        [
            (r"weight$", P("model", None)),
            (r"layers\[0\]\.weight$", P(None, "model")),
            (MISSPELT, P()),
        ],
        default=P(),
    )
    with jax.set_mesh(_mesh()):
        placed = eqxs.filter_device_put(net, rules)
    table = eqxs.sharding_table(placed, name="net", rules=rules)
    lines = table.splitlines()
    total = next(i for i, line in enumerate(lines) if line.startswith("total"))
    rows = {
        line.split()[0]: line.split("  ")[-1].strip() for line in lines[2 : total - 1]
    }
    assert rows["net.attention.query_proj.weight"] == "#0 weight$"
    assert rows["net.mlp.layers[0].weight"] == "#0 weight$ (over #1)"
    assert rows["net.mlp.layers[0].bias"] == "default"
    assert lines[total + 1 :] == [
        "",
        "unused rules (matched no array):",
        f"  #2 {MISSPELT}",
        "overlaps (first match wins):",
        r"  net.mlp.layers[0].weight: #0 weight$ won over #1 layers\[0\]\.weight$",
    ]


def test_sharding_table_rules_per_argument():
    net = _net()
    batch = np.zeros((8, 8), np.float32)
    rules = eqxs.PathRules([(r"weight$", P("model", None))], default=P())
    table = eqxs.sharding_table((net, batch), rules=(rules, None))
    lines = table.splitlines()
    assert lines[-1].startswith("total")  # nothing unused, no overlaps: no notes
    by_path = {line.split()[0]: line.split("  ")[-1].strip() for line in lines[2:-2]}
    assert by_path["[0].mlp.layers[1].weight"] == "#0 weight$"
    assert by_path["[0].mlp.layers[1].bias"] == "default"
    assert by_path["[1]"] == "-"  # not beneath a `PathRules`
    no_default = eqxs.PathRules([(r"weight$", P())])
    table = eqxs.sharding_table(net.mlp, rules=no_default)
    assert table.splitlines()[3].endswith("no rule")
    assert table.splitlines()[-2:] == [
        "no rule and no default (placing this tree would raise):",
        "  .layers[0].bias, .layers[1].bias",
    ]


#
# Reading a report, and a pattern anchored where no key path starts.
#


def test_report_str_is_a_table_of_rules_and_problems():
    net = _net()
    rules = eqxs.PathRules(
        [
            (r"query_proj\.weight$", P("model", None)),
            (MISSPELT, P(None, "model")),
            (r"weight$", P()),
        ],
        default=P(),
    )
    report = eqxs.explain_rules(net, rules, name="net")
    # 6 weights (query, key, value, output; 2 in the MLP) and 2 biases.
    assert str(report).splitlines() == [
        r"rule  pattern                         spec              arrays",
        r"0     query_proj\.weight$             P('model', None)  1",
        r"1     atention\.output_proj\.weight$  P(None, 'model')  0",
        r"2     weight$                         P()               5",
        r"      default                         P()               2",
        r"unused: rule 1 `atention\.output_proj\.weight$` matched no array",
        "overlap: net.attention.query_proj.weight is placed by rule 0, also matched "
        "by rule 2",
    ]


def test_a_pattern_anchored_before_the_first_key_suggests_the_path():
    net = _net()
    anchored = r"^mlp\.layers\[0\]\.weight$"
    rules = eqxs.PathRules([(anchored, P("model", None))], default=P())
    report = eqxs.explain_rules(net, rules)
    assert report.unused == (eqxs.RuleMatch(0, anchored, P("model", None)),)
    assert report.did_you_mean == {anchored: r"^\.mlp\.layers\[0\]\.weight$"}
    assert r"did you mean `^\.mlp\.layers\[0\]\.weight$`?" in str(report)
    # Under a tuple the path starts with its index.
    report = eqxs.explain_rules((net, _adam(net)), rules)
    assert report.did_you_mean == {anchored: r"^\[0\]\.mlp\.layers\[0\]\.weight$"}
    # The suggestion matches, and a pattern that is not anchored gets none.
    fixed = eqxs.PathRules([(report.did_you_mean[anchored], P())], default=P())
    assert not eqxs.explain_rules((net, _adam(net)), fixed).unused
    assert eqxs.explain_rules(net, _rules()).did_you_mean == {}
    # Where strict rules raise, they say the same.
    strict = eqxs.PathRules(rules.rules, default=P(), strict=True)
    with pytest.raises(
        ValueError, match=re.escape(r"'^\\.mlp\\.layers\\[0\\]\\.weight$'?")
    ):
        eqxs.filter_device_put(net, strict)
    table = eqxs.sharding_table(net, rules=rules)
    assert (
        r"#0 ^mlp\.layers\[0\]\.weight$ (did you mean ^\.mlp\.layers\[0\]\.weight$?)"
        in table
    )


def test_strict_puts_each_problem_on_its_own_line():
    rules = eqxs.PathRules([(r"^x$", P()), (r"^y$", P())], default=P(), strict=True)
    with jax.set_mesh(_mesh()), pytest.raises(ValueError) as error:
        eqxs.filter_device_put({"w": np.zeros(8, np.float32)}, rules)
    lines = str(error.value).splitlines()
    assert [line.split(" matched")[0] for line in lines[1:3]] == [
        "- rule 0 '^x$'",
        "- rule 1 '^y$'",
    ], lines
    assert lines[3].startswith("With `strict=True` each rule must match"), lines
