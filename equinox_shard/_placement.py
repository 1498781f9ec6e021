"""Placing the array leaves of a PyTree with `jax.device_put`, keeping every buffer
that the caller did not donate (RFC §6): where JAX would hand back a buffer of the
source, or free one it was not given, the source is copied first or not donated."""

import operator
from collections.abc import Callable
from itertools import compress, repeat
from typing import Any

import jax
import jax._src.traceback_util as traceback_util
from jax.sharding import (
    AxisType,
    NamedSharding,
    PartitionSpec,
    Sharding,
    SingleDeviceSharding,
)

from . import _multihost
from ._arrays import (
    in_default_memory,
    is_committed,
    is_deleted,
    is_key_array,
    is_tracer,
    raise_if_deleted,
)
from ._buffers import (
    private_copies,
    shares_single_device_buffer,
    shares_source_buffer,
)
from ._spec.kinds import kind_of, sharding_of
from ._spec.language import check


traceback_util.register_exclusion(__file__)


_UNCONSTRAINED = PartitionSpec.UNCONSTRAINED


def _without_unconstrained(sharding: NamedSharding) -> NamedSharding:
    spec = PartitionSpec(
        *(None if entry is _UNCONSTRAINED else entry for entry in sharding.spec)
    )
    return NamedSharding(sharding.mesh, spec, memory_kind=sharding.memory_kind)


def same_mesh(current: Sharding, target: Sharding) -> bool:
    """Whether an array placed on `current` may stand for one placed on `target`, given
    that the two are equivalent: the mesh is part of an array's type (Explicit axes
    appear in it, and JAX requires the inputs of one computation to share a mesh), so
    an equivalent sharding over another mesh, or over other axis types, is not enough.
    """
    current_named = isinstance(current, NamedSharding)
    target_named = isinstance(target, NamedSharding)
    if current_named and target_named:
        return current.mesh == target.mesh  # pyright: ignore[reportAttributeAccessIssue]
    if current_named or target_named:
        named = current if current_named else target
        return AxisType.Explicit not in named.mesh.axis_types  # pyright: ignore
    return True


def is_placed(x: jax.Array, sharding: Sharding) -> bool:
    """Whether the committed array `x` may stand for one placed on `sharding`."""
    current = x.sharding
    if current == sharding:
        return True
    try:
        return current.is_equivalent_to(sharding, x.ndim) and same_mesh(
            current, sharding
        )
    except Exception:  # Not equivalent; a later `check` names the problem if any.
        return False


def _is_on(x: jax.Array, target: Any) -> bool:
    """Whether the committed array `x` may stand for one placed on `target`, a value
    of a kind that is not a `Sharding`: on the sharding it gives (if any), and as its
    kind asks in the rest (`_spec.kinds.Kind.is_placed`: a layout, a memory)."""
    kind: Any = kind_of(target)
    sharding = kind.sharding(target)
    return (sharding is None or is_placed(x, sharding)) and kind.is_placed(x, target)


def _onto_shardings_first(leaves: list, indices: list, targets: list) -> tuple:
    """Places each array whose target's kind needs it there first
    (`_spec.kinds.Kind.sharding_first`: a `Format`) onto the target's sharding, in
    place, as a copy that owns its buffers; returns the `indices` and `targets` still to
    place: those whose target asks for more (a layout) than that gave."""
    move = [
        k
        for k, (i, t) in enumerate(zip(indices, targets))
        if not isinstance(t, Sharding)
        and kind_of(t).sharding_first  # pyright: ignore[reportOptionalMemberAccess]
        and isinstance(leaves[i], jax.Array)
        and not (leaves[i].committed and is_placed(leaves[i], sharding_of(t)))  # pyright: ignore
    ]
    if not move:
        return indices, targets
    sources = [leaves[indices[k]] for k in move]
    shardings = [sharding_of(targets[k]) for k in move]
    private_copies(
        sources,
        [
            j
            for j, (x, s) in enumerate(zip(sources, shardings))
            if shares_source_buffer(x, s)
        ],
    )
    done = set()
    for k, x in zip(move, jax.device_put(sources, shardings)):
        leaves[indices[k]] = x
        if _is_on(x, targets[k]):
            done.add(k)
    keep = [k for k in range(len(indices)) if k not in done]
    return [indices[k] for k in keep], [targets[k] for k in keep]


def all_placed(values, expected: tuple) -> bool:
    """Whether every value is a committed `jax.Array` whose sharding equals its target,
    `expected` holding `(True, sharding)` per value (one C-speed pass). `False` means
    `place` must look: `jax.jit` may not be given an array on another sharding
    (upstream/jax-reports/jit-committed-device-order)."""
    try:
        return all(map(operator.eq, map(_placement, values), expected))
    except (AttributeError, TypeError):  # NumPy, a tracer, a `ShapeDtypeStruct`
        return False


def jit_takes(values, expected: tuple) -> int:
    """Whether `jax.jit` takes every value as it is for its target in `expected`, a
    `Sharding` in the default memory of devices of this process: `PLACED` where each is
    a committed `jax.Array` on its target, `MOVES` where some are not committed
    (uncommitted, NumPy: `jax.jit` moves them itself) and the committed ones are on
    theirs, `0` where one is not (`jax.jit` refuses it: `place` must look). C-speed:
    one `committed` lookup per value, and one `sharding` per committed value."""
    try:
        # A weak-typed input is placed by `place`: an executable of a strong type runs
        # a weak one without complaint (and the other way round), with other dtypes.
        if any(map(getattr, values, _WEAK, _FALSE)):
            return 0
        committed = list(map(getattr, values, _COMMITTED, _FALSE))
        held = map(_sharding, compress(values, committed))
        if not all(map(_eq, held, compress(expected, committed))):
            return 0
        return PLACED if all(committed) else MOVES
    except Exception:  # a tracer: `place` leaves it to the enclosing call
        return 0


# `jit_takes`'s answers (both true).
PLACED = 1
MOVES = 2
_placement = operator.attrgetter("committed", "sharding")
_sharding = operator.attrgetter("sharding")
_eq = operator.eq
_FALSE = repeat(False)
_COMMITTED = repeat("committed")
_WEAK = repeat("weak_type")


# The `(shape, sharding)` pairs that `check` passed (it depends on nothing else),
# emptied when full.
_fits: set = set()


def _fit(shape: tuple, sharding: Any) -> None:
    if len(_fits) >= 4096:
        _fits.clear()
    _fits.add((shape, sharding))


def _shares_source_buffer(x: Any, target: Any, memo: dict) -> bool:
    """`shares_source_buffer` for the sharding that `target` gives (one that keeps
    the array's own always copies: `_spec.kinds.Kind.sharding`), once per `(x.sharding,
    x.shape, target)` in `memo`."""
    if not isinstance(x, jax.Array):
        return False
    if not x.committed:  # pyright: ignore[reportAttributeAccessIssue]
        # On one device, whose buffer JAX shares only onto several devices, replicated.
        spread = memo.get(id(target))
        if spread is None:
            sharding = sharding_of(target)
            spread = memo[id(target)] = (
                sharding is not None and shares_single_device_buffer(sharding)
            )
        if not spread:
            return False
    key = (x.sharding, x.shape, target)
    found = memo.get(key)
    if found is None:
        sharding = sharding_of(target)
        found = memo[key] = sharding is not None and shares_source_buffer(x, sharding)
    return found


def _refuse_donated_aliases(todo: list, donate: Any, may_alias: Any, where) -> None:
    for i, _ in todo:
        donated = donate[i] if isinstance(donate, list) else donate
        aliased = may_alias[i] if isinstance(may_alias, list) else may_alias
        if donated and aliased:
            raise ValueError(
                f"{where(i)}: `donate` and `may_alias` are both True for this array; "
                "`jax.device_put` takes one or the other (donating hands the input's "
                "buffers to the result, aliasing lets the result share them)."
            )


def place(
    leaves: list,
    todo: list[tuple[int, Any]],
    where: Callable[[int], str],
    *,
    donate: list | bool | None = False,
    may_alias: list | bool | None = None,
) -> None:
    """Places `leaves[i]` on `target` for each `(i, target)` in `todo` (a resolved
    spec leaf: a `Sharding`, or a value of a kind whose row says how it is placed,
    `_spec.kinds.Kind.target`) with one batched `jax.device_put`, in place: the one
    placement of `filter_device_put`, `filter_shard`, `filter_jit`'s inputs and
    process-local data. `donate` and `may_alias` are `jax.device_put`'s, per leaf
    (lists are indexed by leaf index). Arrays that already carry an equivalent sharding
    are left as the same object (unless `may_alias=False`). Every other result owns its
    buffers, unless donated or `may_alias=True`: donating it later never deletes the
    input. `where(i)` names leaf `i` in errors."""
    if donate is not False and may_alias:
        _refuse_donated_aliases(todo, donate, may_alias, where)
    indices = []
    targets = []
    given: Any = None  # the last spec leaf, and the sharding placed for it
    concrete: Any = None
    spread = None  # whether `concrete` spans several devices, replicated
    # The leaves whose buffer `jax.device_put` might share with the result
    # (`_shares_source_buffer`), and those whose deletion the loop did not test.
    sharing = set()
    unchecked = []
    first = False  # a target that needs the array on its sharding first
    per_leaf = isinstance(may_alias, list)
    for i, sharding in todo:
        leaf = leaves[i]
        flag = may_alias[i] if per_leaf else may_alias  # pyright: ignore
        if sharding is not given and not isinstance(sharding, Sharding):
            # Another kind: its row says what `jax.device_put` is given.
            check(leaf.shape, sharding, lambda i=i: where(i))
            kind: Any = kind_of(sharding)
            if kind.target is not None:
                sharding = kind.target(leaf, sharding, lambda i=i: where(i))
            if not isinstance(sharding, Sharding):
                if flag is not False and is_committed(leaf):
                    if is_deleted(leaf):
                        raise_if_deleted(
                            leaves, (i,), where, then=", so it cannot be placed"
                        )
                    if _is_on(leaf, sharding):
                        continue
                first = first or kind_of(sharding).sharding_first  # pyright: ignore
                sharing.add(i)
                unchecked.append(i)
                indices.append(i)
                targets.append(sharding)
                continue
        if sharding is given:  # most leaves share one spec leaf
            sharding = concrete
        else:
            given = sharding
            if isinstance(sharding, NamedSharding) and _UNCONSTRAINED in sharding.spec:
                # A transfer needs a concrete layout: an unconstrained dimension
                # (which only a compiler can choose) is placed replicated, as eager
                # `with_sharding_constraint` (an identity `jit`) does.
                sharding = _without_unconstrained(sharding)
            concrete = sharding
            spread = None
        # `is_concrete` and `is_deleted`, inline: once per leaf.
        if isinstance(leaf, jax.Array) and not is_tracer(leaf):
            if leaf.is_deleted():  # pyright: ignore[reportAttributeAccessIssue]
                raise_if_deleted(leaves, (i,), where, then=", so it cannot be placed")
            if leaf.committed:  # pyright: ignore[reportAttributeAccessIssue]
                if flag is not False and (
                    leaf.sharding == sharding or is_placed(leaf, sharding)
                ):
                    continue
                sharing.add(i)
            else:  # JAX shares a single-device buffer only onto several, replicated
                if spread is None:
                    spread = shares_single_device_buffer(sharding)
                if spread:
                    sharing.add(i)
        shape = leaf.shape
        if (shape, sharding) not in _fits:
            check(shape, sharding, lambda i=i: where(i))
            _fit(shape, sharding)
        indices.append(i)
        targets.append(sharding)
    if not indices:
        return
    # Before any transfer, so that a failure cannot leave earlier leaves donated.
    if unchecked:
        raise_if_deleted(leaves, unchecked, where, then=", so it cannot be placed")
    if jax.process_count() > 1:
        # Host-local arrays onto shardings that span several processes.
        indices, targets = _multihost.place_host_local(leaves, indices, targets, where)
        if not indices:
            return
    if first:
        indices, targets = _onto_shardings_first(leaves, indices, targets)
        if not indices:
            return
    repeated = None
    if len(set(map(id, map(leaves.__getitem__, indices)))) < len(indices):
        indices, targets, repeated = _first_occurrences(leaves, indices, targets)
    if isinstance(donate, list):
        donate = [donate[i] for i in indices]
    # A result owns its buffers unless the caller donated the input or allowed
    # aliasing with `may_alias=True`; `None` therefore means "copy unless donated".
    if isinstance(may_alias, list) or isinstance(donate, list):
        flags = [
            may_alias[i] if isinstance(may_alias, list) else may_alias for i in indices
        ]
        donated = donate if isinstance(donate, list) else [donate] * len(indices)
        may_alias = [
            None if d and f is None else bool(f) for f, d in zip(flags, donated)
        ]
        copy = [f is False for f in may_alias]
    else:
        may_alias = None if donate and may_alias is None else bool(may_alias)
        copy = [may_alias is False] * len(indices)
    sources = [leaves[i] for i in indices]
    early = []
    if sharing:
        shares: dict = {}  # per (source sharding, shape, target): most leaves share one
        early = [
            k
            for k, (i, x, t) in enumerate(zip(indices, sources, targets))
            if copy[k] and i in sharing and _shares_source_buffer(x, t, shares)
        ]
    if early:
        # A private copy on the source device first, whose buffer may then be shared.
        private_copies(sources, early)
    if donate is not False and any(map(is_key_array, sources)):
        # Key arrays are never donated here (JAX frees them without marking them
        # deleted): upstream/jax-reports/device-put-donate-single-device-sharding.
        flags = donate if isinstance(donate, list) else [donate] * len(sources)
        donate = [d and not is_key_array(x) for d, x in zip(flags, sources)]
        if not isinstance(may_alias, list):
            may_alias = [may_alias] * len(sources)
        may_alias = [
            False if f is None and not d else f for f, d in zip(may_alias, donate)
        ]
    if donate is not False:
        # The device itself, not its `SingleDeviceSharding` (JAX 0.10.2):
        # upstream/jax-reports/device-put-donate-single-device-sharding.
        targets = [
            next(iter(s.device_set))
            if type(s) is SingleDeviceSharding and in_default_memory(s)
            else s
            for s in targets
        ]
    first = targets[0]
    if targets.count(first) == len(targets):
        targets = first  # one sharding, which `jax.device_put` need not broadcast
    out = jax.device_put(sources, targets, donate=donate, may_alias=may_alias)
    for i, leaf in zip(indices, out):
        leaves[i] = leaf
    if repeated:
        for i, j in repeated:
            leaves[i] = leaves[j]


def _first_occurrences(leaves: list, indices: list, targets: list) -> tuple:
    """An array placed twice on one target (tied weights) is placed once, and every
    occurrence gets that one result: two results sharing its buffer (donated, or
    `may_alias=True`) would be freed under each other by a later donation. Returns
    the `indices` and `targets` to place, and `(i, j)` for each leaf `i` that takes
    leaf `j`'s result."""
    first: dict = {}
    keep_indices, keep_targets, repeated = [], [], []
    for i, target in zip(indices, targets):
        try:
            key = (id(leaves[i]), target)
            j = first.setdefault(key, i)
        except TypeError:  # an unhashable target: by identity
            key = (id(leaves[i]), id(target))
            j = first.setdefault(key, i)
        if j == i:
            keep_indices.append(i)
            keep_targets.append(target)
        else:
            repeated.append((i, j))
    return keep_indices, keep_targets, repeated
