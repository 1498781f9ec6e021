"""The kinds of spec leaf, in one table (`KINDS`). For each kind it owns: its type and
the name messages give it; whether a value is valid, and the hint if not; whether
resolving it depends on the context mesh; the `Sharding` its placement gives an array
(`sharding_of`); which functions take it; and how it is applied inside a trace and
by `filter_jit`'s `in_shardings` and `out_shardings`. Modules that treat one kind
apart from another in these respects read the table (`_spec`, `_spec_leaves`,
`_sharding`, `_entry`, `_traced`).

What a kind means is not all here. Outside the table:

- resolution: `_spec.resolve` turns a `jax.Device` into a `SingleDeviceSharding` and
    a bare `PartitionSpec` into a `NamedSharding` on the context mesh by testing their
    types itself, and `_spec.resolve_each` takes a `Sharding` as resolved;
- eager placement: `_place.place` (with `_format_target`, `_is_formatted` and
    `_onto_format_shardings`) places a `Format` on its layout and sharding and a
    `jax.memory.Space` in that memory by testing their types itself;
- `Layout.AUTO` (`is_auto`): `_entry._auto_layouts` and `_entry.AutoLayouts`
    (compiled before a call), `_callbacks._own_layouts` (the arguments' own layouts
    for such an executable) and `_traced._eager_targets` (under `jax.disable_jit`, the
    sharding alone);
- `Format(None, None)` (`is_empty_format`) is `None` wherever `_spec.resolve` runs.

A callable rule and a `PathRules` are not kinds: they choose, per array, a spec leaf
of one of these kinds (`_spec_leaves`).
"""

import enum
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
from jax.experimental.layout import Format, Layout
from jax.sharding import PartitionSpec, Sharding


class InTrace(enum.Enum):
    """How a kind is applied inside a trace."""

    # `jax.sharding.reshard` or `jax.lax.with_sharding_constraint`.
    CONSTRAIN = "constrain"
    # `jax.device_put`, as JAX does in a trace.
    TRANSFER = "transfer"
    # Refused, with `Kind.in_trace_hint`.
    REFUSED = "refused"


class Kind(NamedTuple):
    """One kind of spec leaf (see the module's docstring)."""

    # Its Python type, and how messages name it.
    type: type
    name: str
    # Whether resolving it depends on the context mesh (`jax.set_mesh`).
    needs_mesh: bool = False
    # The `Sharding` that its placement gives an array, to check the array's shape
    # against and to test buffer reuse; `None`: the array's own.
    sharding: Callable[[Any], Any] = lambda x: x
    # Whether a value of `type` is a spec leaf, and the hint of the error if not.
    valid: Callable[[Any], bool] = lambda x: True
    invalid: str = ""
    # Whether it is a spec leaf of `filter_device_put`, `filter_shard` and
    # `filter_jit` only, and the hint of the `TypeError` raised elsewhere.
    placement_only: bool = False
    placement_hint: str = ""
    # How it is applied inside a trace, and the hint where that is refused.
    in_trace: InTrace = InTrace.CONSTRAIN
    in_trace_hint: str = ""
    # Whether `jax.jit` refuses it in `filter_jit`'s `in_shardings`, and the hint.
    jit_in_refused: bool = False
    jit_in_hint: str = ""
    # In `out_shardings`: "jit" (given to `jax.jit`) or "body" (applied to the output
    # inside the function, as in a trace, where `jax.jit` refuses it).
    jit_out: Literal["jit", "body"] = "jit"


KINDS: tuple[Kind, ...] = (
    Kind(Sharding, "`jax.sharding.Sharding`"),
    # Resolved to a `SingleDeviceSharding`, and to a `NamedSharding` on the context
    # mesh, before anything else reads the table.
    Kind(jax.Device, "`jax.Device`"),
    Kind(PartitionSpec, "`jax.sharding.PartitionSpec`", needs_mesh=True),
    Kind(
        Format,
        "`jax.experimental.layout.Format` (layout and sharding)",
        sharding=lambda x: x.sharding,
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
    # Moves an array to host or device memory keeping its sharding, as
    # `jax.device_put(x, Space.Host)` does; `jax.jit` takes it in neither
    # `in_shardings` nor `out_shardings` (JAX 0.10.2 and 0.12).
    Kind(
        jax.memory.Space,
        "`jax.memory.Space`",
        sharding=lambda x: None,
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
    """The kind of the spec leaf `x`, or `None` (`None`, a rule, a `PathRules`, or not
    a spec leaf)."""
    kind = _BY_TYPE.get(type(x))
    if kind is None and isinstance(x, TYPES):
        kind = next(k for k in KINDS if isinstance(x, k.type))
    return kind


def is_kind(x: Any) -> bool:
    """Whether `x` is a valid spec leaf of one of the kinds."""
    kind = kind_of(x)
    return kind is not None and kind.valid(x)


def is_empty_format(x: Any) -> bool:
    """Whether `x` is `Format(None, None)`, which `jax.device_put` takes as "leave the
    array as it is" (and `Compiled.input_formats` gives for an input XLA pruned): a
    spec leaf that means `None`."""
    return type(x) is Format and x.layout is None and x.sharding is None


def is_auto(x: Any) -> bool:
    """Whether `x` is a `Format` whose layout the compiler chooses (`Layout.AUTO`)."""
    return type(x) is Format and x.layout is Layout.AUTO


def sharding_of(x: Any) -> Any:
    """The `Sharding` that a resolved spec leaf gives an array (`None`: its own)."""
    kind = _BY_TYPE.get(type(x))
    return x if kind is None else kind.sharding(x)


def names() -> str:
    """The kinds, as a message lists them."""
    return "".join(f"a {kind.name}, " for kind in KINDS)
