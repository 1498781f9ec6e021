"""Placing the array leaves of a PyTree, keeping every buffer the caller did not donate
(RFC §6): `plan` (which leaves move, onto what; raises before anything moves), then
`transfer` (private copies, donation, the one `jax.device_put`)."""

import functools as ft
from collections.abc import Callable
from itertools import repeat
from typing import Any

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec, Sharding

from . import _multihost
from ._arrays import (
    identity_hash,
    in_default_memory,
    is_committed,
    is_key_array,
    is_tracer,
    raise_if_deleted,
)
from ._buffers import private_copies, shares_single_device_buffer, shares_source_buffer
from ._dispatch import dispatch_lock
from ._spec.kinds import kind_of, sharding_of
from ._spec.language import check_shapes, for_jax


_UNCONSTRAINED = PartitionSpec.UNCONSTRAINED


def same_mesh(current: Sharding, target: Sharding) -> bool:
    """Whether equivalent shardings `current` and `target` share a mesh: the mesh is
    part of an array's type, so an equivalent one over another mesh is not enough; on
    Explicit axes so is the spec (`P()` and `P("x")` are equivalent on one device)."""
    meshes = [getattr(s, "mesh", None) for s in (current, target)]
    named = meshes[0] if meshes[0] is not None else meshes[1]
    explicit = named is not None and AxisType.Explicit in named.axis_types
    if None not in meshes:
        return meshes[0] == meshes[1] and (
            not explicit or trimmed_spec(current) == trimmed_spec(target)
        )
    return not explicit


def trimmed_spec(sharding: Any) -> tuple:
    """A `NamedSharding`'s spec without trailing `None`s (`P("x")`, `P("x", None)`)."""
    spec = tuple(sharding.spec)
    while spec and spec[-1] is None:
        spec = spec[:-1]
    return spec


def is_placed(x: jax.Array, sharding: Sharding) -> bool:
    """Whether the committed array `x` may stand for one placed on `sharding`."""
    current = x.sharding
    try:
        return current == sharding or (
            current.is_equivalent_to(sharding, x.ndim) and same_mesh(current, sharding)
        )
    except Exception:  # Not equivalent; a later `check` names the problem if any.
        return False


def _is_on(x: jax.Array, target: Any) -> bool:
    """Whether the committed array `x` may stand for one placed on `target`, a value
    of a kind that is not a `Sharding` (`_spec.kinds.Kind.is_placed`)."""
    kind: Any = kind_of(target)
    sharding = kind.sharding(target)
    return (sharding is None or is_placed(x, sharding)) and kind.is_placed(x, target)


def place(
    leaves: list,
    todo: list[tuple[int, Any]],
    where: Callable[[int], str],
    *,
    donate: list | bool | None = False,
    may_alias: list | bool | None = None,
) -> None:
    """Places `leaves[i]` on `target` for each `(i, target)` in `todo`, in place: the
    one placement of the package. `donate` and `may_alias` are `jax.device_put`'s,
    per leaf; every result owns its buffers unless donated or `may_alias=True`."""
    if donate is not False and may_alias:
        for i, _ in todo:
            if _flag(donate, i) and _flag(may_alias, i):
                raise ValueError(
                    f"{where(i)}: `donate` and `may_alias` are both True for this "
                    "array; `jax.device_put` takes one or the other (donating hands "
                    "the input's buffers to the result, aliasing lets the result "
                    "share them)."
                )
    # `plan` looks for deleted leaves, and `transfer` moves them, under the lock of
    # `filter_jit`'s donating launches: another thread may donate a leaf meanwhile.
    with dispatch_lock:
        moves = plan(leaves, todo, where, may_alias)
        if moves is not None and moves[0]:
            transfer(leaves, *moves, where, donate, may_alias)
    if moves is None:  # inside a trace
        check_shapes(leaves, todo, where)
        indices = [i for i, _ in todo]
        flags = [
            [x[i] for i in indices] if isinstance(x, list) else x
            for x in (donate, may_alias)
        ]
        _put(leaves, indices, [for_jax(t) for _, t in todo], *flags)


def _flag(flags: Any, i: int) -> Any:
    return flags[i] if isinstance(flags, list) else flags


def plan(
    leaves: list, todo: list, where: Callable[[int], str], may_alias
) -> tuple[list, list, set] | None:
    """Which of `todo`'s leaves move, and onto what: `(indices, targets, sharing)`,
    `sharing` the leaves whose buffer the result might share; `None` inside a trace.
    Raises, naming the leaf, before anything moves."""
    indices: list = []
    targets: list = []
    sharing = set()
    given: Any = None  # the last `Sharding` given, and the one placed for it
    concrete: Any = None
    spread = None  # whether `concrete` spans several devices, replicated
    per_leaf = isinstance(may_alias, list)
    for i, target in todo:
        leaf = leaves[i]
        if is_tracer(leaf):
            return None
        if target is given:  # most leaves share one spec leaf
            target = concrete
        elif isinstance(target, Sharding):
            given = target
            if isinstance(target, NamedSharding) and _UNCONSTRAINED in target.spec:
                # Unconstrained: replicated, as eager `with_sharding_constraint` does.
                spec = [None if e is _UNCONSTRAINED else e for e in target.spec]
                target = NamedSharding(
                    target.mesh, PartitionSpec(*spec), memory_kind=target.memory_kind
                )
            concrete, spread = target, None
        else:  # another kind: its row says what `jax.device_put` is given
            kind: Any = kind_of(target)
            if kind.target is not None:
                target = kind.target(leaf, target, ft.partial(where, i))
        if isinstance(leaf, jax.Array):
            if leaf.is_deleted():
                raise_if_deleted(leaves, (i,), where, then=", so it cannot be placed")
            if leaf.committed:
                if (may_alias[i] if per_leaf else may_alias) is not False and (
                    leaf.sharding == target or is_placed(leaf, target)
                    if isinstance(target, Sharding)
                    else _is_on(leaf, target)
                ):
                    continue
                sharing.add(i)
            elif target is not concrete:  # of another kind
                sharing.add(i)
            else:  # JAX shares a single-device buffer only onto several, replicated
                if spread is None:
                    spread = shares_single_device_buffer(target)
                if spread:
                    sharing.add(i)
        indices.append(i)
        targets.append(target)
    if indices:
        check_shapes(leaves, zip(indices, targets), where)
    return indices, targets, sharing


def transfer(
    leaves: list,
    indices: list,
    targets: list,
    sharing: set,
    where: Callable[[int], str],
    donate: Any,
    may_alias: Any,
) -> None:
    """Moves each `leaves[i]` onto its target, in place, with one `jax.device_put`,
    after a private copy of each source in `sharing` whose buffer it would share."""
    if jax.process_count() > 1:
        # Host-local arrays onto shardings that span several processes.
        indices, targets = _multihost.place_host_local(leaves, indices, targets, where)
    if not all(map(isinstance, targets, repeat(Sharding))):
        indices, targets = _onto_shardings_first(leaves, indices, targets)
    if not indices:
        return
    repeated = []
    if len(set(map(identity_hash, map(leaves.__getitem__, indices)))) < len(indices):
        indices, targets, repeated = _first_occurrences(leaves, indices, targets)
    n = len(indices)
    if isinstance(donate, list) or isinstance(may_alias, list) or donate:
        donated = [bool(_flag(donate, i)) for i in indices]
        for k, i in enumerate(indices):
            # Key arrays are not donated here: JAX frees them unmarked (`may_donate`).
            donated[k] = donated[k] and not is_key_array(leaves[i])
        # `None`: "copy unless donated".
        aliased = [
            None if d and _flag(may_alias, i) is None else bool(_flag(may_alias, i))
            for d, i in zip(donated, indices)
        ]
    else:
        donated, aliased = False, [bool(may_alias)] * n
    if sharing:
        memo: dict = {}
        copies = [
            k
            for k, (i, target) in enumerate(zip(indices, targets))
            if aliased[k] is False
            and i in sharing
            and _shares_source_buffer(leaves[i], target, memo)
        ]
        # A private copy on the source device first, whose buffer may then be shared.
        sources = [leaves[i] for i in indices]
        private_copies(sources, copies)
        for k in copies:
            leaves[indices[k]] = sources[k]
    asked = [k for k, d in enumerate(donated) if d] if donated is not False else []
    donors = [leaves[indices[k]] for k in asked]
    if donated is not False:
        for k, x in zip(asked, donors):
            donated[k] = may_donate(x, targets[k])
    try:
        _put(leaves, indices, targets, donated, aliased)
    except ValueError:  # refused before anything moved
        if not _replicated_first(leaves, indices, targets):
            raise
        _put(leaves, indices, targets, donated, aliased)
    # A donation that JAX (or `may_donate`) does not take is a copy: no result shares
    # a buffer with a source that stays alive.
    private_copies(
        leaves,
        [
            indices[k]
            for k, x in zip(asked, donors)
            if isinstance(x, jax.Array)
            and not x.is_deleted()
            and _buffers(x) & _buffers(leaves[indices[k]])
        ],
    )
    for i, j in repeated:
        leaves[i] = leaves[j]


def may_donate(x: Any, target: Any) -> bool:
    """Not from one device onto one, where JAX 0.10.2 frees `x` unmarked, nor into
    another memory (upstream/jax-reports/device-put-donate-single-device-sharding)."""
    source = getattr(x, "sharding", None)
    if source is None or not isinstance(target, Sharding):
        return True
    if _memory(source) != _memory(target):
        return False
    return len(source.device_set) > 1 or len(target.device_set) > 1


def _buffers(x: jax.Array) -> set:
    return {shard.data.unsafe_buffer_pointer() for shard in x.addressable_shards}


def _memory(sharding: Sharding) -> Any:
    return None if in_default_memory(sharding) else sharding.memory_kind


def _put(leaves: list, indices: list, targets: Any, donate: Any, may_alias: Any):
    """The one `jax.device_put` of `leaves[i]` onto its target, in place."""
    if targets.count(targets[0]) == len(targets):
        targets = targets[0]  # one sharding, which `jax.device_put` need not broadcast
    sources = list(map(leaves.__getitem__, indices))
    out = jax.device_put(sources, targets, donate=donate, may_alias=may_alias)
    for i, x in zip(indices, out):
        leaves[i] = x


def _shares_source_buffer(x: Any, target: Any, memo: dict) -> bool:
    """`shares_source_buffer` for the sharding that `target` gives, memoised."""
    if not isinstance(x, jax.Array):
        return False
    key = (x.sharding, x.shape, target)
    found = memo.get(key)
    if found is None:
        sharding = sharding_of(target)
        found = memo[key] = sharding is not None and shares_source_buffer(x, sharding)
    return found


def _onto_shardings_first(leaves: list, indices: list, targets: list) -> tuple:
    """Places arrays whose target needs it (`Kind.sharding_first`) onto the target's
    sharding first, in place; returns the `indices` and `targets` still to place."""
    first = [
        k
        for k, (i, t) in enumerate(zip(indices, targets))
        if getattr(kind_of(t), "sharding_first", False)
        and isinstance(leaves[i], jax.Array)
        and not (is_committed(leaves[i]) and is_placed(leaves[i], sharding_of(t)))
    ]
    if not first:
        return indices, targets
    sources = [leaves[indices[k]] for k in first]
    shardings = [sharding_of(targets[k]) for k in first]
    shared = zip(sources, shardings)
    private_copies(
        sources, [j for j, xs in enumerate(shared) if shares_source_buffer(*xs)]
    )
    done = set()
    for k, x in zip(first, jax.device_put(sources, shardings)):
        leaves[indices[k]] = x
        if _is_on(x, targets[k]):
            done.add(k)
    keep = [k for k in range(len(indices)) if k not in done]
    return [indices[k] for k in keep], [targets[k] for k in keep]


def _replicated_first(leaves: list, indices: list, targets: list) -> bool:
    """Replicates first, in place, each array whose type names another number of
    devices than it is on, which `jax.device_put` refuses onto a split sharding."""
    first = [
        (i, NamedSharding(t.mesh, PartitionSpec(), memory_kind=t.memory_kind))
        for i, t in zip(indices, targets)
        if isinstance(t, NamedSharding)
        and isinstance(leaves[i], jax.Array)
        and leaves[i].committed
        and jax.typeof(leaves[i]).sharding.mesh.size
        != len(leaves[i].sharding.device_set)
    ]
    if first:
        moved = jax.device_put([leaves[i] for i, _ in first], [s for _, s in first])
        for (i, _), x in zip(first, moved):
            leaves[i] = x
    return bool(first)


def _first_occurrences(leaves: list, indices: list, targets: list) -> tuple:
    """An array placed twice on one target (tied weights) is placed once: two results
    sharing its buffer would be freed under each other. Returns `indices`, `targets`
    and `(i, j)` for each leaf `i` that takes leaf `j`'s result."""
    first: dict = {}
    keep_indices, keep_targets, repeated = [], [], []
    for i, target in zip(indices, targets):
        try:
            j = first.setdefault((id(leaves[i]), target), i)
        except TypeError:  # an unhashable target: by identity
            j = first.setdefault((id(leaves[i]), id(target)), i)
        if j == i:
            keep_indices.append(i)
            keep_targets.append(target)
        else:
            repeated.append((i, j))
    return keep_indices, keep_targets, repeated
