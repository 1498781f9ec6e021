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
    """One rule of a [`equinox_shard.PathRules`][]: `RuleMatch(index, pattern, spec)`,
    with `index` its position in `PathRules.rules` and `pattern` as written, or
    `(None, "default", spec)` for the default.
    """

    index: int | None
    pattern: str
    spec: Any


class RuleOverlap(NamedTuple):
    """An array that several rules matched: `won` placed it (first match wins),
    `lost` are the others, in order."""

    won: RuleMatch
    lost: tuple[RuleMatch, ...]


@dataclasses.dataclass(frozen=True)
class RulesReport:
    """What the [`equinox_shard.PathRules`][] of a specification do to a PyTree, as
    returned by [`equinox_shard.explain_rules`][]. Arrays are named by their key
    path in the whole tree, prefixed by `name`.

    **Fields:**

    - `placed`: key path -> the [`equinox_shard.RuleMatch`][] that placed the array
        (a rule or the default), in the order of the tree's leaves.
    - `unused`: the rules whose pattern was found in no array's key path. A rule
        that matched only arrays an earlier rule placed is in `overlaps` instead.
    - `overlaps`: key path -> [`equinox_shard.RuleOverlap`][], for each array that
        more than one rule matched.
    - `unmatched`: the key paths of the arrays that no rule matched, beneath a
        `PathRules` without a default (placing the tree would raise).
    - `did_you_mean`: for an unused pattern anchored at the start (`^embed`), which
        never matches as key paths start with `.` or `[`: the pattern anchored after
        that start, where it matches a key path (`^\\.embed`).

    `not report.unused and not report.overlaps` is what `PathRules(..., strict=True)`
    checks. `str(report)` is a table of the rules and how many arrays each places,
    followed by the problems.
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
        counts.sort(key=lambda row: (row[0].index is None, row[0].index or 0))
        rows = [("rule", "pattern", "spec", "arrays")] + [
            ("" if m.index is None else str(m.index), m.pattern, str(m.spec), str(n))
            for m, n in counts
        ]
        lines = columns(rows)
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


def columns(rows: list[tuple[str, ...]], right: int | None = None) -> list[str]:
    """`rows` as lines of aligned columns (column `right` aligned right)."""
    widths = [max(map(len, column)) for column in zip(*rows)]
    return [
        "  ".join(
            cell.rjust(w) if j == right else cell.ljust(w)
            for j, (cell, w) in enumerate(zip(row, widths))
        ).rstrip()
        for row in rows
    ]


def explain_rules(
    tree: PyTree[Any], specs: PyTree[Any], *, name: str = ""
) -> RulesReport:
    r"""Says which rule of the [`equinox_shard.PathRules`][] in a specification
    places each array of a PyTree, which rules match nothing, and which arrays
    several rules match. It matches as placing `tree` with `specs` would, but places
    nothing, needs no mesh, and raises nothing it reports.

    **Arguments:**

    - `tree`: any PyTree. Its arrays and `jax.ShapeDtypeStruct`s are matched.
    - `specs`: a sharding specification of `tree`, as given to
        [`equinox_shard.filter_device_put`][]. For a `filter_jit` call, pass its
        arguments as one tuple and its `in_shardings` as a tuple of the same length.
    - `name`: prepended to every key path, e.g. `name="model"` gives
        `model.layers[0].weight`.

    **Returns:**

    A [`equinox_shard.RulesReport`][]. Equal `PathRules` count as one, over every
    subtree they cover.

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
