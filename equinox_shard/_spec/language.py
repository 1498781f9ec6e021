"""The sharding-specification language shared by every public function.

A specification is a PyTree prefix of a value whose leaves are spec leaves: one of the
kinds of `kinds.KINDS` (a `jax.sharding.Sharding`, a `jax.Device`, a
`jax.experimental.layout.Format`, a `jax.memory.Space`, a bare
`jax.sharding.PartitionSpec`), `None` (leave it as it is), a callable
`leaf -> spec leaf`, or a `PathRules`. `resolve_leaves` resolves one against a value,
per array leaf; errors name the leaf by its key path in the user's argument names.
"""

import contextlib
import dataclasses
import functools as ft
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np
from equinox import is_array
from jax.sharding import NamedSharding, Sharding
from jax.tree_util import PyTreeDef

from .._arrays import DEFAULT_MEMORY, on_abstract_mesh
from .kinds import is_kind, kind_of, names, sharding_of
from .leaves import (
    check_spec_leaf,
    describe_leaf,
    is_pytree_node,
    is_rule,
    is_spec_leaf,
    may_be_own_leaf,
    one_level,
    PathRules,
    RulesUsage,
)


def flatten_specs(
    specs: Any,
    name: str,
    where: Callable[[tuple], str] | None = None,
    *,
    placement: bool = True,
    jit_in: bool = False,
    own_leaves: bool = False,
) -> tuple[list, PyTreeDef]:  # pyright: ignore[reportInvalidTypeForm]
    """A specification's spec leaves, each checked and named `name` plus its key path
    (or `where(path)`); `own_leaves`: those of `may_be_own_leaf` go to `spread`."""
    leaves, treedef = jtu.tree_flatten(specs, is_leaf=is_spec_leaf)
    if not all(map(is_spec_leaf, leaves)):  # the slow path names the leaf
        # Placement-only kinds where nothing is placed; inputs `jax.jit` refuses.
        refused = lambda kind: (
            (kind.placement_only and not placement) or (kind.jit_in_refused and jit_in)
        )
        for path, leaf in jtu.tree_flatten_with_path(specs, is_leaf=is_spec_leaf)[0]:
            if own_leaves and may_be_own_leaf(leaf):
                continue
            at = name + jtu.keystr(path) if where is None else where(path)
            check_spec_leaf(leaf, at, refused)
    return leaves, treedef


def _describe_node(x: Any) -> str:
    if isinstance(x, (jax.Array, np.ndarray, np.generic)):
        shape = tuple(x.shape)  # pyright: ignore[reportAttributeAccessIssue]
        return f"an array leaf of shape {shape} and dtype {x.dtype}"
    if not is_pytree_node(x) and x is not None:
        return f"a leaf ({describe_leaf(x)})"
    if isinstance(x, dict):
        return f"a {type(x).__name__} with keys {sorted(map(repr, x.keys()))}"
    if isinstance(x, (list, tuple)):
        return f"a {type(x).__name__} of length {len(x)}"
    if x is None:
        return "None (an empty subtree)"
    return f"an instance of {type(x).__module__}.{type(x).__qualname__}"


def _first_mismatch(spec: Any, value: Any, path: tuple) -> tuple[tuple, str] | None:
    """`(path, explanation)` where `spec` first stops being a prefix of `value`."""
    if is_spec_leaf(spec) or isinstance(spec, bool):  # `donate=`'s bools too
        return None
    found = f"the specification has {_describe_node(spec)}"
    differs = f"{found} whereas the value has {_describe_node(value)}"
    if not is_pytree_node(value) and value is not None:
        return path, differs
    if type(spec) is type(value) and isinstance(spec, dict) and isinstance(value, dict):
        missing = sorted(value.keys() - spec.keys(), key=repr)
        extra = sorted(spec.keys() - value.keys(), key=repr)
        if missing:  # both sides are named: a key on each is usually one misspelt
            others = ", ".join(map(repr, extra))
            also = f"; the specification has {others}, which the value does not"
            return (
                path + (jtu.DictKey(missing[0]),),
                "the value has this key but the specification does not"
                + also * bool(extra),
            )
        if extra:
            return (
                path + (jtu.DictKey(extra[0]),),
                "the specification has this key but the value does not",
            )
    spec_def, value_def = one_level(spec), one_level(value)
    same_data = spec_def.node_data() == value_def.node_data()
    if not same_data and type(spec) is type(value) and is_pytree_node(spec):
        spec_data = spec_def.node_data()[1]  # pyright: ignore[reportOptionalSubscript]
        value_data = value_def.node_data()[1]  # pyright: ignore[reportOptionalSubscript]
        if fields := static_fields_differing(spec, value):
            said = (f"{n}={x!r} (the value's: {y!r})" for n, x, y in fields)
            differ = "whose static fields differ from the value's"
            return path, f"{found} {differ}: {', '.join(said)}"
        return path, (
            f"{found} whose static (non-PyTree) data differs from the value's: the "
            f"specification's is {spec_data!r}, the value's {value_data!r}"
        )
    if not same_data or spec_def.num_leaves != value_def.num_leaves:
        return path, differs
    spec_children = jtu.tree_flatten_with_path(spec, is_leaf=lambda y: y is not spec)[0]
    value_children = jtu.tree_leaves(value, is_leaf=lambda y: y is not value)
    for (key, spec_child), value_child in zip(spec_children, value_children):
        found = _first_mismatch(spec_child, value_child, path + key)
        if found is not None:
            return found
    return None


def static_fields_differing(a: Any, b: Any) -> list[tuple[str, Any, Any]]:
    """`(name, a's, b's)` for each static dataclass field (an Equinox Module's
    `field(static=True)`) where `a` and `b` differ."""
    out = []
    for field in dataclasses.fields(a) if dataclasses.is_dataclass(a) else ():
        x, y = getattr(a, field.name, None), getattr(b, field.name, None)
        if field.metadata.get("static", False) and not equal(x, y):
            out.append((field.name, x, y))
    return out


def equal(a: Any, b: Any) -> bool:
    """`a == b` as a bool, or where that raises (arrays), `a is b`."""
    with contextlib.suppress(Exception):
        return bool(a == b)
    return a is b


def broadcast_specs(
    spec_leaves: list,
    spec_def: PyTreeDef,  # pyright: ignore[reportInvalidTypeForm]
    specs: Any,
    value: Any,
    num_leaves: int,
    spec_name: str,
    value_name: str,
) -> list:
    """One spec leaf per leaf of `value`: each broadcast over its subtree."""
    if spec_def.num_leaves == 1 and spec_def.num_nodes == 1:
        return spec_leaves * num_leaves
    try:
        return broadcast_prefix(spec_leaves, spec_def, value)
    except (ValueError, TypeError):
        path, explanation = _first_mismatch(specs, value, ()) or ((), "they differ")
        raise ValueError(
            f"`{spec_name}` must be a PyTree prefix of `{value_name}`, but at "
            f"{value_name}{jtu.keystr(path)} {explanation}."
        ) from None


def broadcast_prefix(prefix_leaves: list, prefix_def: PyTreeDef, value: Any) -> list:  # pyright: ignore[reportInvalidTypeForm]
    """Each prefix leaf once per leaf beneath it."""
    out = []
    for leaf, subtree in zip(prefix_leaves, prefix_def.flatten_up_to(value)):
        out.extend([leaf] * len(jtu.tree_leaves(subtree)))
    return out


def spread(
    specs: Any,
    value: Any,
    leaves: list,
    spec_name: str,
    value_name: str,
    where: Callable[[int], str],
    selected: Callable[[Any], bool],
    usage: RulesUsage | None = None,
    *,
    placement: bool = True,
) -> list:
    """One spec leaf per leaf of `value` (`leaves`), each `PathRules` replaced by its
    choice (`None` where not `selected`, or unmatched if `usage.everything`). Strict
    rules are checked here, or given a `usage`, by the caller's `usage.check()`."""
    try:
        spec_leaves, spec_def = flatten_specs(specs, spec_name, placement=placement)
    except TypeError:
        # `Compiled.input_shardings` and `input_formats` hold non-array leaves as is.
        specs, at = _own_leaves_as_none(specs, value, selected, spec_name, value_name)
        spec_leaves, spec_def = flatten_specs(specs, spec_name, at, placement=placement)
    out = broadcast_specs(
        spec_leaves, spec_def, specs, value, len(leaves), spec_name, value_name
    )
    if not any(isinstance(s, PathRules) for s in spec_leaves):
        return out
    own = usage is None
    usage = usage or RulesUsage()
    start = 0
    for spec, subtree in zip(spec_leaves, spec_def.flatten_up_to(value)):
        if not isinstance(spec, PathRules):
            start += len(jtu.tree_leaves(subtree))
            continue
        seen = usage.add(spec, spec_name) if usage.everything or spec.strict else None
        paths = jtu.tree_flatten_with_path(subtree)[0]
        for i, (path, _) in enumerate(paths, start):
            if not selected(leaves[i]):
                out[i] = None
                continue
            key = jtu.keystr(path)
            if seen is not None:
                seen.append((lambda i=i: where(i), key, spec.matches(key)))
            k = spec.match(key)
            if k is None and usage.everything:
                out[i] = None  # `explain_rules` reports it
            elif k is None:
                raise ValueError(
                    f"{where(i)}: no rule matches its key path {key!r} and the "
                    f"`PathRules` has no `default`. Patterns, in order: "
                    f"{[p for p, _ in spec.rules]}."
                )
            else:
                out[i] = spec.default if k == len(spec.rules) else spec.rules[k][1]
        start += len(paths)
    if own:
        usage.check()
    return out


def _own_leaves_as_none(
    specs: Any, value: Any, selected: Callable, spec_name: str, value_name: str
) -> tuple[Any, Callable[[tuple], str] | None]:
    """`specs` with each non-spec leaf over no `selected` leaf that may be (or is) the
    value's own (`may_be_own_leaf`) as `None`, and how `flatten_specs` names a leaf
    left; `specs` and `None` if they do not line up."""

    def own_as_none(spec: Any, subtree: Any) -> Any:
        if is_spec_leaf(spec) or any(map(selected, jtu.tree_leaves(subtree))):
            return spec
        if spec is subtree or may_be_own_leaf(spec):
            return None
        try:  # a string: the value's own if equal
            same = type(spec) is type(subtree) and bool(spec == subtree)
        except Exception:  # e.g. an array's truth value: not the same
            same = False
        return None if same else spec

    try:
        specs = jtu.tree_map(own_as_none, specs, value, is_leaf=is_spec_leaf)
    except (ValueError, TypeError):
        return specs, None
    at = lambda path: (
        f"{value_name}{''.join(key_names(value, path))} (`{spec_name}"
        f"{jtu.keystr(path)}`)"
    )
    return specs, at


def resolve_each(
    per_leaf: list,
    leaves: list,
    indices,
    where: Callable[[int], str],
    resolver: Callable[[Any, Any, Callable[[], str]], Any],
) -> list[tuple[int, Any]]:
    """Each `(i, resolved spec)` of `indices` whose spec does not resolve to `None`."""
    out = []
    for i in indices:
        spec = per_leaf[i]
        if spec is not None and not isinstance(spec, Sharding):  # needs resolving
            spec = resolver(spec, leaves[i], lambda i=i: where(i))
        if spec is not None:
            out.append((i, spec))
    return out


def needs_mesh(spec: Any) -> bool:
    """Whether resolving `spec` may read the `jax.set_mesh` mesh (a cache key)."""
    kind = kind_of(spec)
    if kind is not None:
        return kind.needs_mesh
    return isinstance(spec, PathRules) or is_rule(spec)


def _concrete_mesh():
    """The `jax.set_mesh` mesh (maybe empty), or `None` while JAX traces."""
    try:
        return jax.sharding.get_mesh()
    except ValueError:
        return None


def in_trace() -> bool:
    return _concrete_mesh() is None


def context_mesh(*, abstract_ok: bool):
    """The `jax.set_mesh` mesh or `None`: the concrete one, but the abstract one if
    `abstract_ok` or inside a trace (where only it exists)."""
    mesh = _concrete_mesh()
    if mesh is not None and not mesh.empty:
        return mesh
    if abstract_ok or mesh is None:
        abstract_mesh = jax.sharding.get_abstract_mesh()
        if not abstract_mesh.empty:
            return abstract_mesh
    return None


def mesh_or_context(mesh: Any, function: str) -> Any:
    """`mesh`, else the abstract `jax.set_mesh` mesh; its errors name `function`."""
    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty:
            raise ValueError(
                f"`{function}` needs a mesh: pass `mesh=...`, or set one with "
                "`jax.set_mesh(mesh)`."
            )
    elif not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
        raise TypeError(
            "mesh must be a `jax.sharding.Mesh` or `AbstractMesh` (or None, for the "
            f"mesh set with `jax.set_mesh`); got {mesh!r}."
        )
    return mesh


def leaf_path(value: Any, index: int, value_name: str) -> str:
    """The key path of the `index`-th leaf of `value`, for error messages."""
    path, _ = jtu.tree_flatten_with_path(value)[0][index]
    return value_name + "".join(key_names(value, path))


def key_names(tree: Any, path: tuple) -> list[str]:
    """`jtu.keystr` of each key of `path` into `tree`, but an `eqx.nn.State`'s entry
    named as `state_specs` names it (`.bn.ema_state_index`) where its marker is the
    key path `eqx.nn.make_with_state` gave it (a `State` flattens without keys)."""
    out = []
    for key in path:
        text = jtu.keystr((key,))
        children = dict(
            jtu.tree_flatten_with_path(tree, is_leaf=lambda y: y is not tree)[0]
        )
        if isinstance(tree, eqx.nn.State) and isinstance(key, jtu.FlattenedIndexKey):
            markers = one_level(tree).node_data()[1]  # pyright: ignore[reportOptionalSubscript]
            marker = markers[key.key] if key.key < len(markers) else None
            if isinstance(marker, str):  # `Model.bn.ema_state_index`: from `.bn`
                text = marker[len(re.split(r"[.\[]", marker, maxsplit=1)[0]) :]
        out.append(text)
        tree = children[(key,)]
    return out


def call_rule(rule: Callable, leaf: Any, where: Callable[[], str]) -> Any:
    """`rule(leaf)`, with an exception it raises re-raised naming the leaf's path."""
    try:
        return rule(leaf)
    except Exception as e:
        raise ValueError(
            f"{where()}: the sharding rule {rule!r} raised {type(e).__name__}: {e}"
        ) from e


def resolve(
    spec: Any, leaf: Any, where: Callable[[], str], *, abstract_ok: bool, mesh=None
) -> Any:
    """One spec leaf resolved against one array leaf by its kind (`Kind.resolve`),
    a bare `PartitionSpec` on `mesh` or else the context mesh."""
    if is_rule(spec):
        rule, spec = spec, call_rule(spec, leaf, where)
        if not (spec is None or is_kind(spec)):
            raise TypeError(
                f"{where()}: the sharding rule {rule!r} must return {names()}or "
                f"`None`; got {describe_leaf(spec)}."
            )
    kind = kind_of(spec)  # `None` for `None`, returned as it is
    if kind is None or kind.resolve is None:
        return spec
    get_mesh = lambda: context_mesh(abstract_ok=abstract_ok) if mesh is None else mesh
    return kind.resolve(spec, get_mesh, where)


def resolve_leaves(
    value: Any,
    leaves: list,
    specs: Any,
    spec_name: str,
    value_name: str,
    *,
    abstract_ok: bool,
    selected: Callable[[Any], bool] = is_array,
    mesh=None,
    placement: bool = False,
) -> list[tuple[int, Any]]:
    """`(leaf index, sharding)` for each `selected` leaf whose spec resolves to one.
    Unless `placement`, a placement-only kind is a `TypeError` naming the leaf."""
    if isinstance(specs, Sharding):  # the common case: nothing to broadcast or resolve
        return [(i, specs) for i, leaf in enumerate(leaves) if selected(leaf)]
    where = lambda i: leaf_path(value, i, value_name)
    per_leaf = spread(
        specs,
        value,
        leaves,
        spec_name,
        value_name,
        where,
        selected,
        placement=placement,
    )
    indices = [i for i, leaf in enumerate(leaves) if selected(leaf)]
    resolver = ft.partial(resolve, abstract_ok=abstract_ok, mesh=mesh)
    out = resolve_each(per_leaf, leaves, indices, where, resolver)
    if not placement:
        for i, sharding in out:
            kind = kind_of(sharding)
            if kind is not None and kind.placement_only:
                raise TypeError(
                    f"{where(i)}: a {kind.name} is a spec leaf of "
                    "`filter_device_put`, `filter_shard` and `filter_jit` only; "
                    f"{kind.placement_hint}. Got {sharding}."
                )
    return out


def for_jax(sharding: Any) -> Any:
    """What to give JAX for a resolved sharding: one on the abstract mesh as its bare
    `PartitionSpec` (no public API reaches the concrete mesh in a trace)."""
    if on_abstract_mesh(sharding) and sharding.memory_kind in DEFAULT_MEMORY:
        return sharding.spec
    return sharding


def devices_along(entry: Any, mesh_shape: dict) -> int:
    """How many parts the `PartitionSpec` entry `entry` splits its dimension into."""
    names = entry if isinstance(entry, tuple) else (entry,)
    return math.prod(mesh_shape[name] for name in names if isinstance(name, str))


def check(shape: Sequence[int], sharding: Any, where: Callable[[], str]) -> None:
    """Raises if the sharding `sharding` gives cannot hold an array of `shape`."""
    sharding = sharding_of(sharding)
    if sharding is None:  # the array keeps its own
        return
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
            parts = devices_along(entry, mesh_shape)
            if size % parts != 0:
                raise ValueError(
                    f"{where()}: dimension {dim} of shape {tuple(shape)} has size "
                    f"{size}, which is not divisible by the {parts} devices of mesh "
                    f"axes {entry!r} (PartitionSpec {spec}, mesh {mesh_shape})."
                )
    else:
        try:
            sharding.shard_shape(tuple(shape))
        except Exception as e:
            raise ValueError(
                f"{where()}: {sharding} cannot shard an array of shape "
                f"{tuple(shape)}: {e}"
            ) from e


# The `(shape, target)` pairs that `check` passed, emptied when full.
_fits: set = set()


def check_shapes(leaves: list, todo, where: Callable[[int], str]) -> None:
    """Raises, naming the leaf, if a target of `todo` cannot hold `leaves[i]`'s shape:
    the one shape check of placement and of `filter_jit`."""
    for i, target in todo:
        shape = getattr(leaves[i], "shape", ())
        try:
            if (shape, target) in _fits:
                continue
            hashable = True
        except TypeError:  # an unhashable target: checked every time
            hashable = False
        check(shape, target, ft.partial(where, i))
        if hashable:
            if len(_fits) >= 4096:
                _fits.clear()
            _fits.add((shape, target))
