"""The sharding-specification language shared by every public function.

A *specification* is a PyTree prefix of a value. Each of its leaves is a spec leaf of
one of the kinds of `kinds.KINDS` (a `jax.sharding.Sharding`, a `jax.Device`, a
`jax.experimental.layout.Format`, a `jax.memory.Space`, a bare
`jax.sharding.PartitionSpec`), `None` (leave the subtree as it is), a callable
`leaf -> spec leaf`, or a `PathRules` (`leaves`). Only array leaves are ever
placed or constrained. This module resolves a specification plus a value to one
`Sharding | None` per array leaf (`resolve_leaves`), and words the errors: each names
the leaf by its key path, rooted at the user's own argument name.
"""

import functools as ft
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.tree_util as jtu
import numpy as np
from equinox import is_array
from jax.sharding import NamedSharding, PartitionSpec, Sharding
from jax.tree_util import PyTreeDef

from .._arrays import DEFAULT_MEMORY, on_abstract_mesh
from .kinds import is_kind, kind_of, names, sharding_of
from .leaves import (
    check_spec_leaf,
    describe_leaf,
    is_pytree_node,
    is_rule,
    is_spec_leaf,
    match_path_rules,
    one_level,
    PathRules,
    RulesUsage,
)


def flatten_specs(
    specs: Any, name: str, where: Callable[[tuple], str] | None = None
) -> tuple[list, PyTreeDef]:  # pyright: ignore[reportInvalidTypeForm]
    """Flattens a specification to its spec leaves, checking each (`name` and the key
    path in errors, or `where(path)`)."""
    leaves, treedef = jtu.tree_flatten(specs, is_leaf=is_spec_leaf)
    for leaf in leaves:
        if not is_spec_leaf(leaf):
            # Slow path: only taken to produce the error message.
            for path, leaf2 in jtu.tree_flatten_with_path(specs, is_leaf=is_spec_leaf)[
                0
            ]:
                at = name + jtu.keystr(path) if where is None else where(path)
                check_spec_leaf(leaf2, at)
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
    spec_def = one_level(spec)
    value_def = one_level(value)
    if (
        type(spec) is type(value)
        and isinstance(spec, dict)
        and isinstance(value, dict)
        and spec.keys() != value.keys()
    ):
        missing = sorted(value.keys() - spec.keys(), key=repr)
        extra = sorted(spec.keys() - value.keys(), key=repr)
        # Both sides are named: a key on each side is usually one misspelt.
        others = ", ".join(map(repr, extra))
        if missing:
            also = f"; the specification has {others}, which the value does not" * bool(
                extra
            )
            return (
                path + (jtu.DictKey(missing[0]),),
                f"the value has this key but the specification does not{also}",
            )
        return (
            path + (jtu.DictKey(extra[0]),),
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
        return broadcast_prefix(spec_leaves, spec_def, value)
    except (ValueError, TypeError):
        raise prefix_error(specs, value, spec_name, value_name) from None


def broadcast_prefix(prefix_leaves: list, prefix_def: PyTreeDef, value: Any) -> list:  # pyright: ignore[reportInvalidTypeForm]
    """Each leaf of a PyTree prefix of `value`, repeated once per leaf of the subtree
    of `value` beneath it. `ValueError` or `TypeError` if it is not a prefix."""
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
    dynamic: Callable[[Any], bool],
    usage: RulesUsage | None = None,
) -> list:
    """The first half of the pipeline, which depends only on structure: one spec leaf
    per leaf of `value` (`leaves`, flattened), each spec leaf broadcast over its subtree
    and each `PathRules` replaced by the spec leaf it chooses; `None` at the leaves
    that are not `dynamic`. `where(i)` names leaf `i` in errors.

    Strict `PathRules` are checked here, before anything is placed or traced: over
    this one specification, or, given a `usage`, over every `spread` that shares it
    (one call's arguments), when the caller calls `usage.check()`."""
    try:
        spec_leaves, spec_def = flatten_specs(specs, spec_name)
    except TypeError:
        # `Compiled.input_shardings`/`input_formats` hold the non-array leaves as
        # themselves: where the value has that very leaf, it is `None`.
        specs = _own_leaves_as_none(specs, value)
        spec_leaves, spec_def = flatten_specs(specs, spec_name)
    per_leaf = broadcast_specs(
        spec_leaves, spec_def, specs, value, len(leaves), spec_name, value_name
    )
    own = usage is None
    if own:
        usage = RulesUsage()
    out = match_path_rules(
        per_leaf, spec_leaves, spec_def, value, leaves, where, dynamic, spec_name, usage
    )
    if own and usage.groups:  # pyright: ignore[reportOptionalMemberAccess]
        usage.check()  # pyright: ignore[reportOptionalMemberAccess]
    return out


def _same_leaf(spec: Any, leaf: Any) -> bool:
    if spec is leaf:
        return True
    try:
        return type(spec) is type(leaf) and bool(spec == leaf)
    except Exception:
        return False


def _own_leaves_as_none(specs: Any, value: Any) -> Any:
    """`specs` with each leaf that is not a spec leaf, but is the value's own leaf at
    that place (the same object, or equal and of the same type), replaced by `None`;
    `specs` itself where the two do not line up (then `flatten_specs` names the
    leaf)."""
    try:
        return jtu.tree_map(
            lambda s, v: None if not is_spec_leaf(s) and _same_leaf(s, v) else s,
            specs,
            value,
            is_leaf=is_spec_leaf,
        )
    except (ValueError, TypeError):
        return specs


def resolve_each(
    per_leaf: list,
    leaves: list,
    indices,
    where: Callable[[int], str],
    resolver: Callable[[Any, Any, Callable[[], str]], Any],
) -> list[tuple[int, Any]]:
    """The second half, which depends on the leaves: `(i, resolver(spec, leaf,
    where))` for every `i` in `indices` whose spec leaf is not `None` and resolves to
    something other than `None`."""
    out = []
    for i in indices:
        spec = per_leaf[i]
        if spec is None:
            continue
        if not isinstance(spec, Sharding):  # a `Sharding` needs no resolving
            spec = resolver(spec, leaves[i], lambda i=i: where(i))
            if spec is None:
                continue
        out.append((i, spec))
    return out


def needs_leaf(spec: Any) -> bool:
    """Whether resolving `spec` depends on the leaf's shape and dtype: part of a cache
    key."""
    return is_rule(spec)


def needs_mesh(spec: Any) -> bool:
    """Whether resolving `spec` may depend on the context mesh (`jax.set_mesh`): part
    of a cache key."""
    kind = kind_of(spec)
    if kind is not None:
        return kind.needs_mesh
    return isinstance(spec, PathRules) or is_rule(spec)


def concrete_mesh():
    """The mesh set by `jax.set_mesh` (empty if none), or `None` while JAX traces,
    where only the abstract mesh exists and `jax.sharding.get_mesh` raises: the
    package's one test of "are we tracing?"."""
    try:
        return jax.sharding.get_mesh()
    except ValueError:
        return None


def in_trace() -> bool:
    return concrete_mesh() is None


def context_mesh(*, abstract_ok: bool):
    """The mesh set by `jax.set_mesh`, or `None` if there is none: the concrete mesh
    outside a trace, the abstract mesh if `abstract_ok` or inside a trace (where only
    the abstract mesh is available, also for leaves that are not tracers)."""
    mesh = concrete_mesh()
    if mesh is not None and not mesh.empty:
        return mesh
    if abstract_ok or mesh is None:
        abstract_mesh = jax.sharding.get_abstract_mesh()
        if not abstract_mesh.empty:
            return abstract_mesh
    return None


def mesh_or_context(mesh: Any, function: str) -> Any:
    """`mesh` if given (a `Mesh` or an `AbstractMesh`), else the mesh set with
    `jax.set_mesh` (abstract: also inside a trace); raises naming `function` if there
    is neither, or if `mesh` is not a mesh."""
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
    spec: Any, leaf: Any, where: Callable[[], str], *, abstract_ok: bool, mesh=None
) -> Any:
    """Resolves one spec leaf against one array leaf, as its kind does
    (`kinds.Kind.resolve`): to a `Sharding`, a value of a kind that needs no
    resolving (a `Format`, a `jax.memory.Space`), or `None`.

    `where()` returns the leaf's key path; it is only called to build an error message.
    A bare `PartitionSpec` resolves against `mesh` if given, else the context mesh.
    """
    if spec is None:
        return None
    if is_rule(spec):
        out = call_rule(spec, leaf, where)
        if not (out is None or is_kind(out)):
            raise TypeError(
                f"{where()}: the sharding rule {spec!r} must return {names()}or "
                f"`None`; got {describe_leaf(out)}."
            )
        if out is None:
            return None
        spec = out
    kind = kind_of(spec)
    if kind is None or kind.resolve is None:
        return spec
    if mesh is None:
        return kind.resolve(spec, lambda: context_mesh(abstract_ok=abstract_ok), where)
    return kind.resolve(spec, lambda: mesh, where)


def resolve_leaves(
    value: Any,
    leaves: list,
    specs: Any,
    spec_name: str,
    value_name: str,
    *,
    abstract_ok: bool,
    dynamic: Callable[[Any], bool] = is_array,
    mesh=None,
    formats: bool = False,
) -> list[tuple[int, Any]]:
    """Returns `(leaf index, sharding)` for every dynamic leaf of `value` whose
    specification resolves to a sharding (i.e. not `None`); bare `PartitionSpec`s
    against `mesh` if given, else the context mesh. A `Format` is returned as it is
    if `formats`, else is a `TypeError` naming the leaf: every `sharding` is then a
    `Sharding`."""
    if isinstance(specs, Sharding):  # the common case: nothing to broadcast or resolve
        return [(i, specs) for i, leaf in enumerate(leaves) if dynamic(leaf)]
    where = lambda i: leaf_path(value, i, value_name)
    per_leaf = spread(specs, value, leaves, spec_name, value_name, where, dynamic)
    indices = [i for i, leaf in enumerate(leaves) if dynamic(leaf)]
    resolver = ft.partial(resolve, abstract_ok=abstract_ok, mesh=mesh)
    out = resolve_each(per_leaf, leaves, indices, where, resolver)
    if not formats:
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
    """What to give JAX for a resolved sharding: one on the abstract mesh (resolved
    inside a trace) as its bare `PartitionSpec`, which JAX resolves against the
    concrete mesh where there is one; no public API reaches that mesh in a trace."""
    if on_abstract_mesh(sharding) and sharding.memory_kind in DEFAULT_MEMORY:
        return sharding.spec
    return sharding


def _spec_entry_size(entry: Any, mesh_shape: dict) -> int:
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        return 1
    names = entry if isinstance(entry, tuple) else (entry,)
    return math.prod(mesh_shape[name] for name in names)


def check(shape: Sequence[int], sharding: Any, where: Callable[[], str]) -> None:
    """Raises if the sharding that the resolved spec leaf `sharding` gives (a
    `Format`'s sharding) cannot hold an array of `shape`: rank or divisibility."""
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
