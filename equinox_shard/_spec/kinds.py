"""The kinds of spec leaf, in one table (`KINDS`) that every module treating kinds
apart reads: how each is named, checked, resolved, placed and applied in a trace.

Not kinds: `Layout.AUTO` (`is_auto`, `filter_jit` only), the `PartitionSpec`s of
`filter_shard_map`, and a rule or a `PathRules` (each chooses a kind per array).
"""

import enum
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
from jax.experimental.layout import Format, Layout
from jax.sharding import NamedSharding, PartitionSpec, Sharding

from .._arrays import is_key_array


class InTrace(enum.Enum):
    """How a kind is applied inside a trace."""

    CONSTRAIN = "constrain"  # `reshard` or `with_sharding_constraint`
    TRANSFER = "transfer"  # `jax.device_put`, as JAX does in a trace
    REFUSED = "refused"  # with `Kind.in_trace_hint`


class Kind(NamedTuple):
    """One kind of spec leaf."""

    # Its Python type, and how messages name it.
    type: type
    name: str
    # `resolve(x, mesh, where)`, the same for every array: a `Sharding`, a value of a
    # kind that needs no resolving, or `None` (leave it); `None` here: `x` itself.
    resolve: Callable[[Any, Callable[[], Any], Callable[[], str]], Any] | None = None
    needs_mesh: bool = False  # whether resolving reads the `jax.set_mesh` mesh
    # The `Sharding` its placement gives an array (`None`: the array's own, moved
    # otherwise, e.g. to another memory, which `jax.device_put` always copies).
    sharding: Callable[[Any], Any] = lambda x: x
    # Eagerly, what `jax.device_put` is given, `target(leaf, x, where)` (`None`: `x`).
    target: Callable[[Any, Any, Callable[[], str]], Any] | None = None
    # Whether a committed array on its `sharding` may stand for one placed on it.
    is_placed: Callable[[Any, Any], bool] = lambda x, target: True
    sharding_first: bool = False  # `jax.device_put` needs the array on it first
    # Whether a value of `type` is a spec leaf, and the hint of the error if not.
    valid: Callable[[Any], bool] = lambda x: True
    invalid: str = ""
    # Whether only placement functions take it, and the hint of the error elsewhere.
    placement_only: bool = False
    placement_hint: str = ""
    # How it is applied inside a trace, and the hint where that is refused.
    in_trace: InTrace = InTrace.CONSTRAIN
    in_trace_hint: str = ""
    # Whether `jax.jit` refuses it in `filter_jit`'s `in_shardings`, and the hint.
    jit_in_refused: bool = False
    jit_in_hint: str = ""
    # In `out_shardings`: "jit" (given to `jax.jit`) or "body" (applied inside).
    jit_out: Literal["jit", "body"] = "jit"


def _on_mesh(spec: PartitionSpec, mesh: Callable[[], Any], where) -> NamedSharding:
    on = mesh()
    if on is None:
        raise ValueError(
            f"{where()}: got the bare PartitionSpec {spec}, but no mesh is set in "
            "this thread. Set one with `jax.set_mesh(mesh)` (per thread: a worker "
            "thread sets its own), or pass `jax.sharding.NamedSharding(mesh, spec)` "
            "instead."
        )
    try:
        return NamedSharding(on, spec)
    except Exception as e:
        # An unknown axis, or one used twice (`DuplicateSpecError`, not a ValueError).
        raise ValueError(f"{where()}: {e}") from e


def _format_target(leaf: Any, fmt: Format, where) -> Any:
    """What `jax.device_put` places `leaf` on for `fmt`: the `Format`, or its sharding
    alone for the default layout or a PRNG key array (laid out as its data, RFC §4)."""
    if fmt.layout is Layout.AUTO:
        raise ValueError(
            f"{where()}: its spec is a `Format` with `Layout.AUTO`, a layout that only "
            "a compiler chooses; an array cannot be placed on it. Lower and compile "
            "first, `compiled = eqxs.filter_jit(f, in_shardings=...).lower(...)"
            ".compile()` (with `jax.ShapeDtypeStruct`s), then place with "
            "`eqxs.filter_device_put(tree, compiled.input_formats)`."
        )
    if fmt.layout is None or is_key_array(leaf):
        return fmt.sharding
    rank = len(fmt.layout.major_to_minor)  # pyright: ignore[reportAttributeAccessIssue]
    if rank != leaf.ndim:
        raise ValueError(
            f"{where()}: the layout of {fmt} has rank {rank}, but the array has shape "
            f"{tuple(leaf.shape)} (rank {leaf.ndim})."
        )
    return fmt


def _has_layout(x: jax.Array, fmt: Format) -> bool:
    """Whether the committed array `x` has the layout of `fmt` (`tiling=None`: any)."""
    try:
        have = x.format.layout  # pyright: ignore[reportAttributeAccessIssue]
    except Exception:
        return False
    want: Any = fmt.layout
    tiling = have.tiling if want.tiling is None else want.tiling
    return have == want.update(tiling=tiling)


def _in_space(x: jax.Array, space: Any) -> bool:
    """Whether the committed array `x` is in `space`'s memory, as `jax.device_put`
    places it: `pinned_host` or the device's own (it moves `unpinned_host` to both)."""
    kind = x.sharding.memory_kind
    if space is jax.memory.Space.Host:
        return kind == "pinned_host"
    return kind in (None, "device")


KINDS: tuple[Kind, ...] = (
    Kind(Sharding, "`jax.sharding.Sharding`"),
    # Resolved before anything else reads the table.
    Kind(
        jax.Device,
        "`jax.Device`",
        resolve=lambda x, mesh, where: jax.sharding.make_single_device_sharding(x),
    ),
    Kind(
        PartitionSpec,
        "`jax.sharding.PartitionSpec`",
        resolve=_on_mesh,
        needs_mesh=True,
    ),
    Kind(
        Format,
        "`jax.experimental.layout.Format` (layout and sharding)",
        # As to `jax.device_put`, `Format(None, None)` leaves the array as it is.
        resolve=lambda x, mesh, where: None if is_empty_format(x) else x,
        sharding=lambda x: x.sharding,
        # `jax.device_put` onto a `Format` over other devices fails (JAX 0.10.2, 0.12).
        target=_format_target,
        is_placed=_has_layout,
        sharding_first=True,
        valid=lambda x: isinstance(x.sharding, Sharding) or is_empty_format(x),
        invalid=" A `Format` must carry a concrete sharding, e.g. "
        "`Format(Layout.AUTO, NamedSharding(mesh, spec))`, or be "
        "`Format(None, None)` (leave the array as it is).",
        placement_only=True,
        placement_hint="here give its sharding, `format.sharding`",
        in_trace=InTrace.REFUSED,
        in_trace_hint="a layout is a property of a jitted function's arguments and "
        "outputs (`filter_jit`'s `in_shardings` and `out_shardings`) or of a placed "
        "array (`filter_device_put`). Inside the function, constrain the sharding with "
        "`format.sharding`, and the layout with "
        "`jax.experimental.layout.with_layout_constraint`",
    ),
    # Moves an array to host or device memory keeping its sharding, as `device_put`
    # does; `jax.jit` takes it as neither in nor out shardings (JAX 0.10.2 and 0.12).
    Kind(
        jax.memory.Space,
        "`jax.memory.Space`",
        sharding=lambda x: None,
        is_placed=_in_space,
        valid=lambda x: x is not jax.memory.Space.Any,
        invalid=" `Space.Any` names no memory to move to: give `Space.Host` or "
        "`Space.Device`.",
        placement_only=True,
        placement_hint="here give a sharding with a memory kind, e.g. "
        "`NamedSharding(mesh, spec, memory_kind='pinned_host')`",
        in_trace=InTrace.TRANSFER,
        jit_in_refused=True,
        jit_in_hint="`jax.jit` takes no memory space for an input: give a sharding "
        "with a memory kind, e.g. "
        "`NamedSharding(mesh, spec, memory_kind='pinned_host')`, or move the input "
        "beforehand with `filter_device_put(x, Space.Host)`",
        jit_out="body",
    ),
)

_BY_TYPE = {kind.type: kind for kind in KINDS}
TYPES = tuple(_BY_TYPE)


def kind_of(x: Any) -> Kind | None:
    """The kind of the spec leaf `x`, or `None` (`None`, a rule, or not a spec leaf)."""
    kind = _BY_TYPE.get(type(x))
    if kind is None and isinstance(x, TYPES):
        kind = next(k for k in KINDS if isinstance(x, k.type))
    return kind


def is_kind(x: Any) -> bool:
    """Whether `x` is a valid spec leaf of one of the kinds."""
    kind = kind_of(x)
    return kind is not None and kind.valid(x)


def is_empty_format(x: Any) -> bool:
    """Whether `x` is `Format(None, None)`, which `jax.device_put` takes as `None`."""
    return type(x) is Format and x.layout is None and x.sharding is None


def is_auto(x: Any) -> bool:
    """Whether `x` is a `Format` whose layout the compiler chooses (`Layout.AUTO`)."""
    return type(x) is Format and x.layout is Layout.AUTO


def sharding_of(x: Any) -> Any:
    """The `Sharding` that a resolved spec leaf gives an array (`None`: its own)."""
    kind = _BY_TYPE.get(type(x))
    return x if kind is None else kind.sharding(x)


def names(refused: Callable[[Kind], bool] = lambda kind: False) -> str:
    """The kinds but the `refused` ones, as a message lists them."""
    return "".join(f"a {kind.name}, " for kind in KINDS if not refused(kind))
