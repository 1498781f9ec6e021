"""Spec leaves: the kinds of leaf a sharding specification may have, and `PathRules`,
the leaf that chooses each array's spec by its key path (see `_spec` for the language
as a whole)."""

import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.tree_util as jtu
from jax.sharding import PartitionSpec, Sharding
from jax.tree_util import PyTreeDef


_SPEC_TYPES = (Sharding, PartitionSpec, jax.Device)
# Callable (as context decorators), but never a sharding rule.
_NOT_RULES = (jax.sharding.Mesh, jax.sharding.AbstractMesh)


def _one_level(x: Any) -> PyTreeDef:  # pyright: ignore[reportInvalidTypeForm]
    return jtu.tree_structure(x, is_leaf=lambda y: y is not x)


def is_pytree_node(x: Any) -> bool:
    # Flattens one level only: this is called on every callable node of a
    # specification, e.g. on every submodule of a Module-shaped one.
    return not jtu.treedef_is_leaf(_one_level(x))


def is_rule(x: Any) -> bool:
    """Whether `x` is a callable spec leaf (a rule `leaf -> spec leaf`)."""
    return (
        callable(x)
        # A class (e.g. `P` for `P()`) is callable but is never a rule.
        and not isinstance(x, type)
        and not isinstance(x, _SPEC_TYPES)
        and not isinstance(x, _NOT_RULES)
        and not is_pytree_node(x)
    )


def is_spec_leaf(x: Any) -> bool:
    return x is None or isinstance(x, (*_SPEC_TYPES, PathRules)) or is_rule(x)


def _describe_leaf(x: Any) -> str:
    text = repr(x)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{type(x).__name__} {text}"


def _check_spec_leaf(x: Any, where: str) -> None:
    if not is_spec_leaf(x):
        hint = ""
        if isinstance(x, _NOT_RULES):
            hint = (
                " A mesh is not a sharding: pass "
                "`jax.sharding.NamedSharding(mesh, spec)`, or set the mesh with "
                "`jax.set_mesh(mesh)` and pass a bare `PartitionSpec`."
            )
        raise TypeError(
            f"{where}: a sharding specification leaf must be a "
            "`jax.sharding.Sharding`, a `jax.Device`, a `jax.sharding.PartitionSpec`, "
            "`None`, a callable `leaf -> spec`, or an `equinox_shard.PathRules`; got "
            f"{_describe_leaf(x)}.{hint}"
        )


class _Unset:
    def __repr__(self):
        return "<unset>"


# The package's one sentinel: an argument not given.
unset: Any = _Unset()


class PathRules:
    r"""A sharding specification leaf that chooses each array's spec by its key path.

    Holds an ordered list of `(pattern, spec)` pairs. For each array leaf beneath it,
    the first pattern that `re.search` finds in the leaf's key path gives that leaf's
    spec; if none does, `default` does. The key path is printed as
    `jax.tree_util.keystr` prints it, *relative to the subtree that this `PathRules`
    covers*: for `filter_device_put(model, rules)` the weight of an `eqx.nn.MLP`'s
    first layer is `.layers[0].weight`, and so it is for
    `filter_jit(in_shardings=(rules, ...))` and for `in_specs=(rules, ...)`. A PyTree
    that holds copies of the parameters, such as an `optax.adamw` state, puts them
    under longer paths that end the same way (`[0].mu.layers[0].weight`), so one list
    of patterns anchored at the end (`r"layers\[\d+\]\.weight$"`) places a model and
    its optimiser state alike; the step count matches nothing and falls to `default`.

    It works wherever a spec leaf works: in [`equinox_shard.filter_device_put`][],
    [`equinox_shard.filter_shard`][], `in_shardings`/`out_shardings` of
    [`equinox_shard.filter_jit`][], and `in_specs`/`out_specs` of
    [`equinox_shard.filter_shard_map`][] (where its specs are `PartitionSpec`s).
    Only array leaves are matched; other leaves are never placed.

    **Arguments:**

    - `rules`: a sequence of `(pattern, spec)` pairs. Each `pattern` is a regular
        expression (a string, or compiled with `re.compile`); each `spec` is a spec
        leaf: a `jax.sharding.Sharding`, a `jax.Device`, a bare
        `jax.sharding.PartitionSpec`, `None` (leave the array as it is), or a
        callable `leaf -> spec`.
    - `default`: the spec leaf for an array that no pattern matches. Without it, such
        an array is a `ValueError` naming its key path.

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

        Here `rules` covers the tuple `(model, opt_state)`, so the paths it sees are
        `[0].layers[0].weight` and `[1][0].mu.layers[0].weight`: both end alike.
    """

    __slots__ = ("_default", "_patterns", "_rules")

    def __init__(
        self,
        rules: Sequence[tuple[str | re.Pattern, Any]],
        *,
        default: Any = unset,
    ):
        patterns = []
        specs = []
        for k, rule in enumerate(rules):
            if not (isinstance(rule, tuple) and len(rule) == 2):
                raise TypeError(
                    f"PathRules: rule {k} must be a pair `(pattern, spec)`; got "
                    f"{_describe_leaf(rule)}."
                )
            pattern, spec = rule
            if not isinstance(pattern, re.Pattern):
                if not isinstance(pattern, str):
                    raise TypeError(
                        f"PathRules: the pattern of rule {k} must be a string or a "
                        f"compiled regular expression; got {_describe_leaf(pattern)}."
                    )
                try:
                    pattern = re.compile(pattern)
                except re.error as e:
                    raise ValueError(
                        f"PathRules: the pattern {pattern!r} of rule {k} is not a "
                        f"regular expression: {e}"
                    ) from e
            _check_rule_spec(
                spec, f"PathRules: the spec of rule {k} ({pattern.pattern!r})"
            )
            patterns.append(pattern)
            specs.append(spec)
        if default is not unset:
            _check_rule_spec(default, "PathRules: `default`")
        self._patterns = tuple(patterns)
        self._rules = tuple(zip((p.pattern for p in patterns), specs))
        self._default = default

    @property
    def rules(self) -> tuple[tuple[str, Any], ...]:
        """The `(pattern, spec)` pairs, in order, with each pattern as a string."""
        return self._rules

    @property
    def default(self) -> Any:
        return self._default

    def match(self, path: str) -> int | None:
        """The index of the first rule whose pattern is found in `path`; `len(rules)`
        if none is and there is a default; `None` if none is and there is no
        default."""
        for k, pattern in enumerate(self._patterns):
            if pattern.search(path) is not None:
                return k
        return len(self._rules) if self._default is not unset else None

    def lookup(self, path: str, where: Callable[[], str]) -> Any:
        """The spec leaf for the array whose relative key path is `path`."""
        k = self.match(path)
        if k is None:
            raise ValueError(
                f"{where()}: no rule matches its key path {path!r} and the "
                f"`PathRules` has no `default`. Patterns, in order: "
                f"{[p for p, _ in self._rules]}."
            )
        return self._default if k == len(self._rules) else self._rules[k][1]

    def describe(self, k: int) -> str:
        """How rule `k` (as `match` returns it) is shown, e.g. by `sharding_table`."""
        return "default" if k == len(self._rules) else self._rules[k][0]

    def __eq__(self, other):
        return (
            type(other) is PathRules
            and self._rules == other._rules
            and self._default == other._default
        )

    def __hash__(self):
        return hash((PathRules, self._rules, self._default))

    def __repr__(self):
        default = "" if self._default is unset else f", default={self._default!r}"
        return f"PathRules({list(self._rules)!r}{default})"


def _check_rule_spec(spec: Any, where: str) -> None:
    if isinstance(spec, PathRules):
        raise TypeError(f"{where}: a `PathRules` cannot hold another `PathRules`.")
    _check_spec_leaf(spec, where)


def match_path_rules(
    per_leaf: list,
    spec_leaves: list,
    spec_def: PyTreeDef,  # pyright: ignore[reportInvalidTypeForm]
    value: Any,
    leaves: list,
    where: Callable[[int], str],
    dynamic: Callable[[Any], bool],
) -> list:
    """Replaces every `PathRules` in `per_leaf` (one spec leaf per leaf of `value`, as
    `broadcast_specs` returns them) by the spec leaf it chooses for that leaf, from the
    leaf's key path relative to the subtree that the `PathRules` covers. Leaves that
    are not `dynamic` get `None`. `where(i)` names leaf `i` in error messages."""
    if not any(isinstance(s, PathRules) for s in spec_leaves):
        return per_leaf
    if spec_def.num_leaves == 1 and spec_def.num_nodes == 1:
        subtrees = [value]
    else:
        subtrees = spec_def.flatten_up_to(value)
    out = list(per_leaf)
    start = 0
    for spec, subtree in zip(spec_leaves, subtrees):
        if not isinstance(spec, PathRules):
            start += len(jtu.tree_leaves(subtree))
            continue
        for path, _ in jtu.tree_flatten_with_path(subtree)[0]:
            i = start
            start += 1
            if not dynamic(leaves[i]):
                out[i] = None
                continue
            out[i] = spec.lookup(jtu.keystr(path), lambda i=i: where(i))
    return out
