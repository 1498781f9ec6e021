"""`sharding_table`: where each array of a PyTree lives, and which rule put it there."""

import collections as co
import math
from typing import Any

import jax.tree_util as jtu
import numpy as np
from jax.sharding import NamedSharding, Sharding
from jaxtyping import PyTree

from ._arrays import (
    in_default_memory,
    is_array_or_struct,
    is_deleted,
    is_single_device_sharding,
    is_tracer,
)
from ._spec.explain_rules import columns, explain_rules, RuleMatch, RulesReport
from ._spec.language import devices_along
from ._state import state_view


_HEADER = ("path", "shape", "dtype", "sharding", "bytes/device")
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def _format_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    exponent = min(int(math.log(n, 1024)), len(_UNITS) - 1)
    return f"{n / 1024**exponent:.1f} {_UNITS[exponent]}"


def _describe_sharding(sharding: Sharding, committed: bool) -> str:
    if isinstance(sharding, NamedSharding):
        text = str(sharding.spec)
    elif is_single_device_sharding(sharding):
        (device,) = sharding.device_set
        text = str(device)
    else:
        text = type(sharding).__name__
    if not in_default_memory(sharding):
        text = f"{text} {sharding.memory_kind}"
    if not committed:
        text = f"{text} uncommitted"
    return text


def _shard_sizes(sharding: Sharding, shape: tuple[int, ...]) -> dict[Any, int]:
    """The number of elements each device holds."""
    if isinstance(sharding, NamedSharding):
        # Not `devices_indices_map`, which rejects an uneven shard (XLA pads it).
        mesh_shape = dict(sharding.mesh.shape)
        size = 1
        for dim, entry in zip(shape, sharding.spec):
            size *= -(-dim // devices_along(entry, mesh_shape))
        size *= math.prod(shape[len(sharding.spec) :])
        return dict.fromkeys(sharding.device_set, size)
    return {
        device: math.prod(len(range(*s.indices(dim))) for s, dim in zip(index, shape))
        for device, index in sharding.devices_indices_map(shape).items()
    }


def _rule_text(match: RuleMatch) -> str:
    return "default" if match.index is None else f"#{match.index} {match.pattern}"


def _rule_cell(report: RulesReport, key: str) -> str:
    match = report.placed.get(key)
    if match is None:
        return "no rule" if key in report.unmatched else "-"
    text = _rule_text(match)
    overlap = report.overlaps.get(key)
    if overlap is not None:
        text += f" (over {', '.join(f'#{m.index}' for m in overlap.lost)})"
    return text


def _rule_notes(report: RulesReport) -> list[str]:
    notes = []
    if report.unused:
        notes.append("unused rules (matched no array):")
        for match in report.unused:
            suggestion = report.did_you_mean.get(match.pattern)
            mean = "" if suggestion is None else f" (did you mean {suggestion}?)"
            notes.append(f"  {_rule_text(match)}{mean}")
    if report.overlaps:
        notes.append("overlaps (first match wins):")
        for key, (won, lost) in report.overlaps.items():
            losers = ", ".join(map(_rule_text, lost))
            notes.append(f"  {key or '(root)'}: {_rule_text(won)} won over {losers}")
    if report.unmatched:
        notes.append("no rule and no default (placing this tree would raise):")
        notes.append("  " + ", ".join(k or "(root)" for k in report.unmatched))
    return [""] + notes if notes else []


def sharding_table(
    tree: PyTree[Any], *, name: str = "", rules: Any = None, model: Any = None
) -> str:
    """Describes how every array in a PyTree is laid out across devices, one row per
    array. Only metadata is read: nothing is transferred, compiled or waited for.

    **Arguments:**

    - `tree`: any PyTree. Each array and each `jax.ShapeDtypeStruct` gets a row;
        other leaves are skipped.
    - `name`: prepended to every key path, e.g. `name="model"` gives
        `model.layers[0].weight`.
    - `rules`: a [`equinox_shard.PathRules`][], or a specification of `tree` holding
        some. A last column then says which rule places each array (`#k pattern`,
        `(over #j)`, `default`, `no rule` or `-`, as docs/why.md explains), and the
        unused rules and the arrays that several rules, or none, matched follow.
    - `model`: for an `eqx.nn.State`, the model it was made with: each entry is then
        named by where its `eqx.nn.StateIndex` is in the model (`.bn.state_index[0]`,
        not `[<flat index 1>][0]`), as [`equinox_shard.state_specs`][] names it.

    **Returns:**

    A string: a header, one line per array, and the bytes held by the most loaded
    device. The sharding column shows the `PartitionSpec` of a `NamedSharding`, the
    device of a `SingleDeviceSharding`, else the type's name; then the memory kind if
    not the default, `uncommitted` for an array `jax.jit` may still move, `deleted` for
    one whose buffers are gone. NumPy arrays show as `host` and traced values as
    `traced`, and count no bytes; an uneven dimension counts as XLA pads it.

    !!! example

        ```python
        mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
        model = eqx.nn.MLP(64, 10, 128, 1, key=jr.key(0))
        split_rows = lambda x: jax.P("data") if x.shape[0] % 8 == 0 else jax.P()
        with jax.set_mesh(mesh):
            model = eqxs.filter_device_put(model, split_rows)
        print(eqxs.sharding_table(model, name="model"))
        ```

        ```
        path                    shape      dtype    sharding    bytes/device
        --------------------------------------------------------------------
        model.layers[0].weight  (128, 64)  float32  P('data',)       4.0 KiB
        model.layers[0].bias    (128,)     float32  P('data',)          64 B
        model.layers[1].weight  (10, 128)  float32  P()              5.0 KiB
        model.layers[1].bias    (10,)      float32  P()                 40 B
        --------------------------------------------------------------------
        total                                                        9.1 KiB
        ```
    """
    if model is not None:
        tree = state_view(model, tree)
    report = None if rules is None else explain_rules(tree, rules, name=name)
    rows = []
    per_device: co.Counter = co.Counter()
    for path, leaf in jtu.tree_flatten_with_path(tree)[0]:
        if not is_array_or_struct(leaf):
            continue
        shape = tuple(leaf.shape)
        itemsize = leaf.dtype.itemsize  # also of extended dtypes (typed PRNG keys)
        size_text = "-"
        if is_tracer(leaf):
            sharding_text = "traced"
        elif isinstance(leaf, (np.ndarray, np.generic)):
            sharding_text = "host"
        elif leaf.sharding is None:  # a `ShapeDtypeStruct` without a sharding
            sharding_text = "unspecified"
        else:
            committed = getattr(leaf, "committed", True)
            sharding_text = _describe_sharding(leaf.sharding, committed)
            if is_deleted(leaf):  # its buffers are gone (e.g. donated)
                sharding_text += " deleted"
            else:
                sizes = _shard_sizes(leaf.sharding, shape)
                for device, size in sizes.items():
                    per_device[device] += size * itemsize
                size_text = _format_bytes(max(sizes.values()) * itemsize)
        key = name + jtu.keystr(path)
        row = (key or "(root)", str(shape), str(leaf.dtype), sharding_text, size_text)
        if report is not None:
            row = (*row, _rule_cell(report, key))
        rows.append(row)
    total = _format_bytes(max(per_device.values())) if per_device else "-"
    header = _HEADER if rules is None else (*_HEADER, "rule")
    total_row = ("total", "", "", "", total) + (() if rules is None else ("",))
    head, *body, end = columns([header, *rows, total_row], right=4)
    rule = "-" * max(len(head), len(end), *map(len, body))
    lines = [head, rule, *body, rule, end]
    if report is not None:
        lines += _rule_notes(report)
    return "\n".join(lines)
