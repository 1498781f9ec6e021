"""What a spec leaf may be (a kind of `kinds`, `None`, a rule `leaf -> spec leaf`, or a
`PathRules`), and `PathRules`, which chooses each array's spec by its key path."""

import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.tree_util as jtu
from equinox import is_array
from jax.tree_util import PyTreeDef

from .kinds import is_kind, kind_of, names as kind_names, TYPES


# Callable (as context decorators), but never a sharding rule.
_NOT_RULES = (jax.sharding.Mesh, jax.sharding.AbstractMesh)


def one_level(x: Any) -> PyTreeDef:  # pyright: ignore[reportInvalidTypeForm]
    return jtu.tree_structure(x, is_leaf=lambda y: y is not x)


def is_pytree_node(x: Any) -> bool:
    # One level only: this is called on every callable node of a specification.
    return not jtu.treedef_is_leaf(one_level(x))


def is_rule(x: Any) -> bool:
    """Whether `x` is a callable spec leaf (a rule `leaf -> spec leaf`)."""
    return (
        callable(x)
        # A class (e.g. `P` for `P()`) is callable but is never a rule.
        and not isinstance(x, type)
        and not isinstance(x, TYPES)
        and not isinstance(x, _NOT_RULES)
        and not is_pytree_node(x)
    )


def is_spec_leaf(x: Any) -> bool:
    return x is None or is_kind(x) or isinstance(x, PathRules) or is_rule(x)


def describe_leaf(x: Any) -> str:
    text = repr(x)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{type(x).__name__} {text}"


def may_be_own_leaf(x: Any) -> bool:
    """Whether `x` may be the value's own non-array leaf (`jax.tree.map` over a Module
    keeps `t1=10.0`): not a string, more often an axis name meant as a spec."""
    return (
        not is_spec_leaf(x)
        and not isinstance(x, str)
        and not isinstance(x, _NOT_RULES)
        and not is_array(x)
        and not is_pytree_node(x)
    )


def check_spec_leaf(
    x: Any, where: str, refused: Callable[[Any], bool] = lambda kind: False
) -> None:
    if not is_spec_leaf(x):
        kind = kind_of(x)
        hint = "" if kind is None else kind.invalid
        if isinstance(x, _NOT_RULES):
            hint = (
                " A mesh is not a sharding: pass "
                "`jax.sharding.NamedSharding(mesh, spec)`, or set the mesh with "
                "`jax.set_mesh(mesh)` and pass a bare `PartitionSpec`."
            )
        raise TypeError(
            f"{where}: a sharding specification leaf must be {kind_names(refused)}"
            "`None`, a callable `leaf -> spec`, or an `equinox_shard.PathRules`; got "
            f"{describe_leaf(x)}.{hint}"
        )


class _Unset:
    def __repr__(self):
        return "<unset>"


# The package's one sentinel: an argument not given.
unset: Any = _Unset()


class PathRules:
    r"""A sharding specification leaf that chooses each array's spec by its key path.

    For each array beneath it, the first pattern that `re.search` finds in the
    array's key path (as `jax.tree_util.keystr` prints it, relative to the subtree
    this `PathRules` covers) gives its spec; if none does, `default` does. Only arrays
    are matched.

    **Arguments:**

    - `rules`: a sequence of `(pattern, spec)` pairs, or a dict `{pattern: spec}`
        (in its order). Each `pattern` is a regular
        expression (a string or an `re.Pattern`); each `spec` is a spec leaf: a
        `jax.sharding.Sharding`, a `jax.Device`, a bare `jax.sharding.PartitionSpec`,
        a `jax.experimental.layout.Format`, a `jax.memory.Space`, `None` (leave the
        array as it is), or a callable `leaf -> spec`.
    - `default`: the spec of an array that no pattern matches. Without it, such an
        array is a `ValueError` naming its key path.
    - `strict`: if `True`, every call that applies these rules raises a `ValueError`,
        before anything is placed or traced, if a rule matches no array (equal rules
        counted as one over the whole call) or an array matches two rules. See
        [`equinox_shard.explain_rules`][] for the same as data.

    !!! example

        ```python
        mesh = jax.make_mesh(
            (4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2
        )
        rules = eqxs.PathRules(
            [
                (r"layers\[0\]\.weight$", P("model", None)),  # column-parallel
                (r"layers\[0\]\.bias$", P("model")),
                (r"layers\[1\]\.weight$", P(None, "model")),  # row-parallel
            ],
            default=P(),
        )
        model = eqx.nn.MLP(64, 10, 128, 1, key=jr.key(0))
        opt_state = optax.adamw(1e-3).init(eqx.filter(model, eqx.is_array))
        with jax.set_mesh(mesh):
            model, opt_state = eqxs.filter_device_put((model, opt_state), rules)
        print(eqxs.sharding_table(opt_state, name="opt_state", rules=rules))
        ```
    """

    __slots__ = ("_default", "_patterns", "_rules", "_strict")

    def __init__(
        self,
        rules: Sequence[tuple[str | re.Pattern, Any]] | dict[str | re.Pattern, Any],
        *,
        default: Any = unset,
        strict: bool = False,
    ):
        if isinstance(rules, dict):  # `{pattern: spec}`, in its order
            rules = list(rules.items())
        patterns, pairs = [], []
        for k, rule in enumerate(rules):
            if not (isinstance(rule, tuple) and len(rule) == 2):
                raise TypeError(
                    f"PathRules: rule {k} must be a pair `(pattern, spec)`; got "
                    f"{describe_leaf(rule)}."
                )
            pattern, spec = rule
            if not isinstance(pattern, (str, re.Pattern)):
                raise TypeError(
                    f"PathRules: the pattern of rule {k} must be a string or a "
                    f"compiled regular expression; got {describe_leaf(pattern)}."
                )
            try:
                pattern = re.compile(pattern)  # a compiled one as it is
            except re.error as e:
                raise ValueError(
                    f"PathRules: the pattern {pattern!r} of rule {k} is not a regular "
                    f"expression: {e}"
                ) from e
            where = f"PathRules: the spec of rule {k} ({pattern.pattern!r})"
            _check_rule_spec(spec, where)
            patterns.append(pattern)
            pairs.append((pattern.pattern, spec))
        if default is not unset:
            _check_rule_spec(default, "PathRules: `default`")
        if not isinstance(strict, bool):
            raise TypeError(f"PathRules: `strict` must be a bool; got {strict!r}.")
        self._patterns = tuple(patterns)
        self._rules = tuple(pairs)
        self._default = default
        self._strict = strict

    @property
    def rules(self) -> tuple[tuple[str, Any], ...]:
        """The `(pattern, spec)` pairs, in order, with each pattern as a string."""
        return self._rules

    @property
    def default(self) -> Any:
        return self._default

    @property
    def strict(self) -> bool:
        return self._strict

    def matches(self, path: str) -> tuple[int, ...]:
        """The indices of every rule whose pattern is found in `path`, in order."""
        return tuple(
            k for k, pattern in enumerate(self._patterns) if pattern.search(path)
        )

    def match(self, path: str) -> int | None:
        """The index of the first rule whose pattern is found in `path`, else
        `len(rules)` if there is a default, else `None`."""
        for k, pattern in enumerate(self._patterns):
            if pattern.search(path) is not None:
                return k
        return len(self._rules) if self._default is not unset else None

    def _key(self) -> tuple:
        # Patterns compare with their flags: `re.I` makes another rule.
        flags = tuple(p.flags for p in self._patterns)
        return self._rules, flags, self._default, self._strict

    def __eq__(self, other):
        return type(other) is PathRules and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __repr__(self):
        default = "" if self._default is unset else f", default={self._default!r}"
        strict = ", strict=True" if self._strict else ""
        return f"PathRules({list(self._rules)!r}{default}{strict})"


def _check_rule_spec(spec: Any, where: str) -> None:
    if isinstance(spec, PathRules):
        raise TypeError(f"{where}: a `PathRules` cannot hold another `PathRules`.")
    check_spec_leaf(spec, where)


class RulesUsage:
    """What the `PathRules` of one call matched (equal ones counted as one): of strict
    ones for `check`, or, if `everything`, of all for `explain_rules`."""

    def __init__(self, *, everything: bool = False):
        self.everything = everything
        # `PathRules` or its id -> [it, its spec names, [(where, path, matches), ...]]
        self.groups: dict[Any, list] = {}

    def add(self, rules: "PathRules", spec_name: str) -> list:
        """The list to append `(where, path, matches)` of rules' leaves to."""
        try:
            group = self.groups.setdefault(rules, [rules, [], []])
        except TypeError:  # an unhashable spec inside: counted by identity
            group = self.groups.setdefault(id(rules), [rules, [], []])
        if spec_name not in group[1]:
            group[1].append(spec_name)
        return group[2]

    def check(self) -> None:
        """Raises if a strict rule matched no array or an array matched two rules."""
        problems, names = [], []
        for rules, spec_names, seen in self.groups.values():
            found = _strict_problems(rules, seen) if rules.strict else []
            if found:
                problems += found
                names += [n for n in spec_names if n not in names]
        if problems:
            lines = "\n".join(f"- {p}" for p in problems)
            raise ValueError(
                f"A `PathRules(..., strict=True)` in {', '.join(names)} does not "
                "give each array exactly one rule:\n"
                f"{lines}\n"
                "With `strict=True` each rule must match the key path of at least "
                "one array, and no array more than one rule, across every argument "
                "the rules apply to in one call. Fix the patterns, or pass "
                "`strict=False` (first match wins; a rule that matches nothing is "
                "ignored); `equinox_shard.explain_rules` shows what each rule "
                "matched."
            )


def some(names: list[str], shown: int = 8) -> str:
    """The first `shown` of `names`, and how many more."""
    more = len(names) - shown
    return ", ".join(names[:shown]) + f" (and {more} more)" * (more > 0)


def did_you_mean(rules: "PathRules", k: int, paths: Sequence[str]) -> str | None:
    """Rule `k`'s `^embed` (no key path matches it: they start with `.` or `[`) as
    `^\\.embed`, anchored after the shortest start where it matches one of `paths`."""
    pattern = rules._patterns[k]
    if not pattern.pattern.startswith("^"):
        return None
    rest = re.compile(pattern.pattern[1:], pattern.flags)
    starts = sorted(
        (j, path)
        for path in set(paths)
        for j in range(1, len(path))
        if path[j - 1] == "." or path[j] == "["
    )
    for j, path in starts:
        if rest.match(path, j):
            return "^" + re.escape(path[:j]) + rest.pattern
    return None


def unused_rules(rules: "PathRules", seen: list) -> list[tuple[int, str | None]]:
    """`(k, did_you_mean(...))` for each rule `k` that matched none of `seen`."""
    used = {k for _, _, matches in seen for k in matches}
    paths = [path for _, path, _ in seen]
    unused = [k for k in range(len(rules.rules)) if k not in used]
    return [(k, did_you_mean(rules, k, paths)) for k in unused]


def _strict_problems(rules: "PathRules", seen: list) -> list[str]:
    problems = []
    fallen = [where() for where, _, matches in seen if not matches]
    if fallen:
        to = "the default" if rules.default is not unset else "no rule"
        hint = f"; the arrays that fell to {to}: {some(fallen)}"
    elif seen:
        hint = f"; every one of its {len(seen)} arrays is placed by another rule"
    else:
        hint = "; it covers no array"
    for k, suggestion in unused_rules(rules, seen):
        problem = f"rule {k} {rules.rules[k][0]!r} matched no key path{hint}."
        if suggestion is not None:
            problem += f" Key paths start with `.` or `[`: did you mean {suggestion!r}?"
        problems.append(problem)
    overlaps: dict[tuple[int, ...], list[str]] = {}
    for where, _, matches in seen:
        if len(matches) > 1:
            overlaps.setdefault(matches, []).append(where())
    for matches, names in overlaps.items():
        won, *lost = (f"rule {k} {rules.rules[k][0]!r}" for k in matches)
        them = "it" if len(names) == 1 else "them"
        every = "both" if len(matches) == 2 else "all"
        problems.append(
            f"{won} and {' and '.join(lost)} {every} match {some(names)}; {won} "
            f"places {them} (first match wins)."
        )
    return problems
