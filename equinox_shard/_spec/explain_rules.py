"""`explain_rules`: what the `PathRules` of a specification do to a PyTree, as data."""

import dataclasses
from typing import Any, NamedTuple

import jax.tree_util as jtu
from jaxtyping import PyTree

from .._arrays import is_array_or_struct
from .language import spread
from .leaves import RulesUsage, some, unset, unused_rules


@dataclasses.dataclass(frozen=True)
class RuleMatch:
    """One rule of a [`equinox_shard.PathRules`][], as [`equinox_shard.RulesReport`][]
    names it: `RuleMatch(index, pattern, spec)`.

    - `index`: its position in `PathRules.rules`; `None` for the default.
    - `pattern`: its pattern as written (`PathRules.rules[index][0]`); `"default"`
        for the default.
    - `spec`: the spec leaf it gives.
    """

    index: int | None
    pattern: str
    spec: Any


class RuleOverlap(NamedTuple):
    """An array whose key path more than one rule matched: a named tuple
    `(won, lost)`. `won` is the first of them, which placed the array (first match
    wins); `lost` are the others, in order."""

    won: RuleMatch
    lost: tuple[RuleMatch, ...]


@dataclasses.dataclass(frozen=True)
class RulesReport:
    """What the [`equinox_shard.PathRules`][] of a specification do to a PyTree, as
    [`equinox_shard.explain_rules`][] returns it. Arrays are named by their key path
    in the whole tree (as `sharding_table` names its rows), prefixed by `name`.

    **Fields:**

    - `placed`: for every array beneath a `PathRules` that a rule or the default
        places, in the order of the tree's leaves, its key path -> the
        [`equinox_shard.RuleMatch`][] that placed it.
    - `unused`: the rules whose pattern was found in no array's key path, over every
        subtree that the rules (or rules equal to them) cover. A rule that matched
        only arrays that an earlier rule placed is not unused: it is in `overlaps`.
    - `overlaps`: for every array whose key path more than one rule matched, its
        key path -> a [`equinox_shard.RuleOverlap`][]: the rule that won and the
        rules that lost.
    - `unmatched`: the key paths of the arrays that no rule matched, beneath a
        `PathRules` without a default (placing the tree would raise a `ValueError`
        naming the first).
    - `did_you_mean`: for each unused rule anchored at the start of the key path
        (`^embed\\.weight$`), which can never match there because every key path
        starts with `.` or `[`: its pattern -> the same pattern anchored after that
        start, where it matches a key path (`^\\.embed\\.weight$`).

    A tree whose rules are all as intended has `not report.unused and not
    report.overlaps and not report.unmatched`: what `PathRules(..., strict=True)`
    checks (except `unmatched`, which raises anyway). `str(report)` is a short table:
    each rule, the number of arrays it places, and the problems below it.
    """

    placed: dict[str, RuleMatch]
    unused: tuple[RuleMatch, ...]
    overlaps: dict[str, RuleOverlap]
    unmatched: tuple[str, ...]
    did_you_mean: dict[str, str] = dataclasses.field(default_factory=dict)

    def __str__(self) -> str:
        placed = list(self.placed.values())
        used: list[RuleMatch] = []  # in order of first use; specs may not hash
        for match in placed:
            if match not in used:
                used.append(match)
        counts = [(m, placed.count(m)) for m in used] + [(m, 0) for m in self.unused]
        rows = [("rule", "pattern", "spec", "arrays")]
        counts.sort(key=lambda row: (row[0].index is None, row[0].index or 0))
        for match, n in counts:
            index = "" if match.index is None else str(match.index)
            rows.append((index, match.pattern, str(match.spec), str(n)))
        widths = [max(len(row[c]) for row in rows) for c in range(3)]
        lines = [
            "  ".join(x.ljust(w) for x, w in zip(row, widths)) + "  " + row[3]
            for row in rows
        ]
        for match in self.unused:
            line = f"unused: rule {match.index} `{match.pattern}` matched no array"
            if match.pattern in self.did_you_mean:
                mean = self.did_you_mean[match.pattern]
                line += f"; key paths start with `.` or `[`: did you mean `{mean}`?"
            lines.append(line)
        for path, (won, lost) in self.overlaps.items():
            losers = ", ".join(str(m.index) for m in lost)
            lines.append(
                f"overlap: {path or '(root)'} is placed by rule {won.index}, also "
                f"matched by rule {losers}"
            )
        if self.unmatched:
            unmatched = some([p or "(root)" for p in self.unmatched])
            lines.append(f"no rule and no default: {unmatched}")
        return "\n".join(lines)


def explain_rules(
    tree: PyTree[Any], specs: PyTree[Any], *, name: str = ""
) -> RulesReport:
    r"""Says what the [`equinox_shard.PathRules`][] in a sharding specification do to
    a PyTree: which rule places each array, which rules match nothing, and which
    arrays more than one rule matches. It matches as placing `tree` with `specs` would
    (by the same code), but raises nothing it reports, places nothing, needs no mesh.

    **Arguments:**

    - `tree`: any PyTree. Its arrays (`equinox.is_array`) and `jax.ShapeDtypeStruct`s
        (a plan, from `equinox.filter_eval_shape`) are matched; other leaves are not.
    - `specs`: a sharding specification for `tree` (a PyTree prefix of it), as given
        to [`equinox_shard.filter_device_put`][], holding one or more `PathRules`.
        Each matches key paths relative to the subtree it covers. To see what
        `filter_jit(f, in_shardings=(rules, rules, P("data")))` does with
        `f(model, opt_state, batch)`, pass `tree=(model, opt_state, batch)` and that
        tuple; a single `in_shardings=rules` is `(rules, rules, rules)` here.
    - `name`: prepended to every key path in the report, e.g. `name="model"` gives
        `model.layers[0].weight`.

    **Returns:**

    A [`equinox_shard.RulesReport`][]. Rules equal to each other (`==`, as
    `filter_jit` caches them) count as one: rules written for a model and applied to
    a model, its optimiser state and a batch are not unused because nothing in the
    batch matches them. Arrays beneath other spec leaves (a `PartitionSpec`, `None`,
    ...) are not in the report.

    !!! example

        ```python
        model = eqx.nn.MLP(64, 10, 128, 1, key=jr.key(0))
        rules = eqxs.PathRules(
            [
                (r"layers\[0\]\.weight$", P("model", None)),
                (r"layer\[1\]\.weight$", P(None, "model")),  # misspelt
            ],
            default=P(),
        )
        report = eqxs.explain_rules(model, rules, name="model")
        report.unused  # (RuleMatch(index=1, pattern='layer\\[1\\]\\.weight$', ...),)
        report.placed["model.layers[1].weight"]  # RuleMatch(None, 'default', P())
        ```

        [`equinox_shard.sharding_table`][] shows the same as a column, with the
        unused rules and the overlaps below the table.
    """
    paths, _ = jtu.tree_flatten_with_path(tree)
    leaves = [leaf for _, leaf in paths]
    names = [name + jtu.keystr(path) for path, _ in paths]
    usage = RulesUsage(everything=True)
    where = names.__getitem__
    spread(
        specs, tree, leaves, "specs", name or "tree", where, is_array_or_struct, usage
    )
    placed: dict[str, RuleMatch] = {}
    overlaps: dict[str, RuleOverlap] = {}
    unmatched: list[str] = []
    unused: list[RuleMatch] = []
    suggestions: dict[str, str] = {}
    for rules, _, seen in usage.groups.values():
        for where, _, matches in seen:
            path = where()
            if matches:
                won, *lost = (RuleMatch(k, *rules.rules[k]) for k in matches)
                placed[path] = won
                if lost:
                    overlaps[path] = RuleOverlap(won, tuple(lost))
            elif rules.default is not unset:
                placed[path] = RuleMatch(None, "default", rules.default)
            else:
                unmatched.append(path)
        for k, suggestion in unused_rules(rules, seen):
            unused.append(RuleMatch(k, *rules.rules[k]))
            if suggestion is not None:
                suggestions[rules.rules[k][0]] = suggestion
    # In the order of the tree's leaves (groups gather equal rules from anywhere).
    order = {path: i for i, path in enumerate(names)}.__getitem__
    placed = {k: placed[k] for k in sorted(placed, key=order)}
    overlaps = {k: overlaps[k] for k in sorted(overlaps, key=order)}
    unmatched.sort(key=order)
    return RulesReport(placed, tuple(unused), overlaps, tuple(unmatched), suggestions)
