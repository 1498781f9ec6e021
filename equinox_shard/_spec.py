"""The sharding-specification language shared by every public function.

A *specification* is a PyTree prefix of a value. Each of its leaves ("spec leaves") is
one of:

- a `jax.sharding.Sharding`;
- a `jax.Device`, meaning `jax.sharding.SingleDeviceSharding(device)`;
- a bare `jax.sharding.PartitionSpec`, resolved against the mesh set by `jax.set_mesh`;
- `None`, meaning "leave this subtree exactly as it is";
- a callable (that is not itself a PyTree node) `leaf -> spec leaf`, called on every
    array leaf beneath it;
- a `PathRules`: an ordered list of regular expressions, each mapped to one of the
    spec leaves above, searched in the key path of every array leaf beneath it.

Only array leaves (`equinox.is_array`) are ever placed or constrained; every other leaf
is returned as the same object, whatever spec sits above it.

This module turns a specification plus a value into one resolved `Sharding | None` per
array leaf, and produces the error messages: each names the offending leaf by its key
path, as `jax.tree_util.keystr` prints it, rooted at the user's own argument name.
"""

import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.tree_util as jtu
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding
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


class _NoDefault:
    def __repr__(self):
        return "<no default>"


_no_default = _NoDefault()


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
        default: Any = _no_default,
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
        if default is not _no_default:
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
        return len(self._rules) if self._default is not _no_default else None

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
        default = "" if self._default is _no_default else f", default={self._default!r}"
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


def flatten_specs(specs: Any, name: str) -> tuple[list, PyTreeDef]:  # pyright: ignore[reportInvalidTypeForm]
    """Flattens a specification down to its spec leaves, checking each leaf's type.

    `name` is what the specification is called in error messages, e.g.
    `"device_or_shardings"` or `"in_shardings"`.
    """
    leaves, treedef = jtu.tree_flatten(specs, is_leaf=is_spec_leaf)
    for leaf in leaves:
        if not is_spec_leaf(leaf):
            # Slow path: only taken to produce the error message.
            for path, leaf2 in jtu.tree_flatten_with_path(specs, is_leaf=is_spec_leaf)[
                0
            ]:
                _check_spec_leaf(leaf2, name + jtu.keystr(path))
    return leaves, treedef


def _describe_node(x: Any) -> str:
    if isinstance(x, (jax.Array, np.ndarray, np.generic)):
        shape = tuple(x.shape)  # pyright: ignore[reportAttributeAccessIssue]
        return f"an array leaf of shape {shape} and dtype {x.dtype}"
    if not is_pytree_node(x) and x is not None:
        return f"a leaf ({_describe_leaf(x)})"
    if isinstance(x, dict):
        return f"a {type(x).__name__} with keys {sorted(map(repr, x.keys()))}"
    if isinstance(x, (list, tuple)):
        return f"a {type(x).__name__} of length {len(x)}"
    if x is None:
        return "None (an empty subtree)"
    return f"an instance of {type(x).__module__}.{type(x).__qualname__}"


def _is_mismatch_leaf(spec: Any) -> bool:
    # Spec leaves, and also the bools of `donate=`/`may_alias=` prefixes, which are
    # broadcast with the same machinery.
    return is_spec_leaf(spec) or isinstance(spec, bool)


def _first_mismatch(spec: Any, value: Any, path: tuple) -> tuple[tuple, str] | None:
    """Walks `spec` and `value` together; returns `(path, explanation)` at the first
    place where `spec` is not a prefix of `value`."""
    if _is_mismatch_leaf(spec):
        return None
    found = f"the specification has {_describe_node(spec)}"
    if not is_pytree_node(value) and value is not None:
        return path, f"{found} whereas the value has {_describe_node(value)}"
    spec_def = _one_level(spec)
    value_def = _one_level(value)
    if (
        type(spec) is type(value)
        and isinstance(spec, dict)
        and isinstance(value, dict)
        and spec.keys() != value.keys()
    ):
        for key in sorted(value.keys() | spec.keys(), key=repr):
            if key not in spec:
                return (
                    path + (jtu.DictKey(key),),
                    "the value has this key but the specification does not",
                )
            if key not in value:
                return (
                    path + (jtu.DictKey(key),),
                    "the specification has this key but the value does not",
                )
    if spec_def.node_data() != value_def.node_data():
        if type(spec) is type(value) and is_pytree_node(spec):
            spec_data = spec_def.node_data()[1]  # pyright: ignore[reportOptionalSubscript]
            value_data = value_def.node_data()[1]  # pyright: ignore[reportOptionalSubscript]
            return path, (
                f"{found} whose static (non-PyTree) data differs from the "
                f"value's: {spec_data!r} vs {value_data!r}"
            )
        return path, f"{found} whereas the value has {_describe_node(value)}"
    if spec_def.num_leaves != value_def.num_leaves:
        return path, f"{found} whereas the value has {_describe_node(value)}"
    spec_children = jtu.tree_flatten_with_path(spec, is_leaf=lambda y: y is not spec)[0]
    value_children = jtu.tree_leaves(value, is_leaf=lambda y: y is not value)
    for (key, spec_child), value_child in zip(spec_children, value_children):
        found = _first_mismatch(spec_child, value_child, path + key)
        if found is not None:
            return found
    return None


def prefix_error(specs: Any, value: Any, spec_name: str, value_name: str) -> ValueError:
    """The error for `specs` not being a PyTree prefix of `value`, naming the first
    mismatching path as `value_name[...]`."""
    found = _first_mismatch(specs, value, ())
    if found is None:  # pragma: no cover - defensive; flatten_up_to disagreed with us.
        return ValueError(
            f"`{spec_name}` is not a PyTree prefix of `{value_name}`: "
            f"{jtu.tree_structure(specs, is_leaf=_is_mismatch_leaf)} vs "
            f"{jtu.tree_structure(value)}."
        )
    path, explanation = found
    return ValueError(
        f"`{spec_name}` must be a PyTree prefix of `{value_name}`, but at "
        f"{value_name}{jtu.keystr(path)} {explanation}."
    )


def broadcast_specs(
    spec_leaves: list,
    spec_def: PyTreeDef,  # pyright: ignore[reportInvalidTypeForm]
    specs: Any,
    value: Any,
    num_leaves: int,
    spec_name: str,
    value_name: str,
) -> list:
    """Returns one spec leaf per leaf of `value` (`num_leaves` of them), by broadcasting
    each spec leaf over the subtree of `value` beneath it."""
    if spec_def.num_leaves == 1 and spec_def.num_nodes == 1:
        return spec_leaves * num_leaves
    try:
        subtrees = spec_def.flatten_up_to(value)
    except (ValueError, TypeError):
        raise prefix_error(specs, value, spec_name, value_name) from None
    out = []
    for spec, subtree in zip(spec_leaves, subtrees):
        out.extend([spec] * len(jtu.tree_leaves(subtree)))
    return out


def context_mesh(*, abstract_ok: bool):
    """The mesh set by `jax.set_mesh`, or `None` if there is none.

    Outside a trace this is the concrete mesh. The abstract mesh is returned if
    `abstract_ok`, or if JAX is tracing: then `jax.sharding.get_mesh` raises and only
    the abstract mesh is available, also for leaves that are not tracers (constants).
    """
    try:
        mesh = jax.sharding.get_mesh()
    except ValueError:
        # Inside `jax.jit` only the abstract mesh is available.
        mesh = None
        abstract_ok = True
    if mesh is not None and not mesh.empty:
        return mesh
    if abstract_ok:
        abstract_mesh = jax.sharding.get_abstract_mesh()
        if not abstract_mesh.empty:
            return abstract_mesh
    return None


def leaf_path(value: Any, index: int, value_name: str) -> str:
    """The key path of the `index`-th leaf of `value`, for error messages."""
    path, _ = jtu.tree_flatten_with_path(value)[0][index]
    return value_name + jtu.keystr(path)


def call_rule(rule: Callable, leaf: Any, where: Callable[[], str]) -> Any:
    """`rule(leaf)`, with an exception it raises re-raised naming the leaf's path."""
    try:
        return rule(leaf)
    except Exception as e:
        raise ValueError(
            f"{where()}: the sharding rule {rule!r} raised {type(e).__name__}: {e}"
        ) from e


def resolve(
    spec: Any, leaf: Any, where: Callable[[], str], *, abstract_ok: bool
) -> Sharding | None:
    """Resolves one spec leaf against one array leaf to a `Sharding`, or `None`.

    `where()` returns the leaf's key path; it is only called to build an error message.
    """
    if spec is None:
        return None
    if is_rule(spec):
        out = call_rule(spec, leaf, where)
        if not (out is None or isinstance(out, _SPEC_TYPES)):
            raise TypeError(
                f"{where()}: the sharding rule {spec!r} must return a "
                "`jax.sharding.Sharding`, a `jax.Device`, a "
                f"`jax.sharding.PartitionSpec` or `None`; got {_describe_leaf(out)}."
            )
        if out is None:
            return None
        spec = out
    if isinstance(spec, jax.Device):
        return SingleDeviceSharding(spec)
    if isinstance(spec, PartitionSpec):
        mesh = context_mesh(abstract_ok=abstract_ok)
        if mesh is None:
            raise ValueError(
                f"{where()}: got the bare PartitionSpec {spec}, but no mesh is set. "
                "Set one with `jax.set_mesh(mesh)`, or pass "
                "`jax.sharding.NamedSharding(mesh, spec)` instead."
            )
        try:
            return NamedSharding(mesh, spec)
        except Exception as e:
            # Unknown mesh axis (ValueError), or an axis used twice (JAX's
            # `DuplicateSpecError`, which is not a ValueError).
            raise ValueError(f"{where()}: {e}") from e
    return spec


def _spec_entry_size(entry: Any, mesh_shape: dict) -> int:
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        return 1
    names = entry if isinstance(entry, tuple) else (entry,)
    return math.prod(mesh_shape[name] for name in names)


def check(shape: Sequence[int], sharding: Sharding, where: Callable[[], str]) -> None:
    """Raises if `sharding` cannot hold an array of `shape`: rank or divisibility."""
    if isinstance(sharding, NamedSharding):
        spec = sharding.spec
        ndim = len(shape)
        if len(spec) > ndim:
            hint = " For scalars the PartitionSpec should be P()." if ndim == 0 else ""
            raise ValueError(
                f"{where()}: PartitionSpec {spec} has {len(spec)} entries, but the "
                f"array has shape {tuple(shape)} (rank {ndim}).{hint}"
            )
        mesh_shape = dict(sharding.mesh.shape)
        for dim, (size, entry) in enumerate(zip(shape, spec)):
            parts = _spec_entry_size(entry, mesh_shape)
            if size % parts != 0:
                raise ValueError(
                    f"{where()}: dimension {dim} of shape {tuple(shape)} has size "
                    f"{size}, which is not divisible by the {parts} devices of mesh "
                    f"axes {entry!r} (PartitionSpec {spec}, mesh "
                    f"{dict(mesh_shape)})."
                )
    else:
        try:
            sharding.shard_shape(tuple(shape))
        except Exception as e:
            raise ValueError(
                f"{where()}: {sharding} cannot shard an array of shape "
                f"{tuple(shape)}: {e}"
            ) from e
