"""JAX's `jax_explain_cache_misses` for `filter_jit` (RFC §13): each miss of our cache,
and each recompile without a retrace beneath, explained on the `equinox_shard` logger in
the caller's names. JAX explains its own retraces. Nothing runs with the flag off."""

import contextlib
import dataclasses
import functools as ft
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.tree_util as jtu

from .._arrays import is_concrete
from .._spec.language import equal, static_fields_differing


logger = logging.getLogger("equinox_shard")
# Frames that are not the caller's: ours, JAX's, and the wrappers between.
_NOT_USER = tuple(
    os.path.dirname(os.path.abspath(str(sys.modules[m].__file__))) + os.sep
    for m in ("jax", "equinox", "jaxtyping", "logging", str(__package__))
) + (contextlib.__file__, ft.__file__)
# `jax.monitoring` events of a `jax.jit`, the same in JAX 0.10.2 and 0.12 (`_heard`).
_TRACE = "/jax/core/compile/jaxpr_trace_duration"
_COMPILE = "/jax/core/compile/backend_compile_duration"
_state = threading.local()  # `.call`: the call `miss`'s layer dispatches


def _user_callsite() -> str:
    frame = sys._getframe(1)
    while frame.f_code.co_filename.startswith(_NOT_USER) and frame.f_back:
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})"


def _short(x: Any) -> str:
    return text if len(text := repr(x)) <= 120 else text[:117] + "..."


def _change(now: Any, before: Any, show: Callable = _short) -> str:
    return f"now {show(now)} and before {show(before)}"


def _mesh(mesh) -> str:
    if mesh is None:
        return "no mesh"
    types = ", ".join(getattr(t, "name", str(t)) for t in mesh.axis_types)
    return f"{type(mesh).__name__}({dict(mesh.shape)}, axis_types=({types}))"


def _array(x) -> dict:
    """What the `jax.jit` beneath keys on, of one traced leaf."""
    out: dict = {"type": jax.typeof(x).str_short(short_dtypes=True)}
    if is_concrete(x):
        s = x.sharding
        named = isinstance(s, jax.sharding.NamedSharding)
        out["sharding"] = f"NamedSharding({_mesh(s.mesh)}, {s.spec})" if named else s
        out["memory kind"] = getattr(s, "memory_kind", None)
        out["committed"] = x.committed
    return out


def _describe(cache, structure, leaves: list, entry=None) -> dict:
    """A call as explanations compare it: its cache keys (`cache.StructureKey`, then
    `cache.EntryKey`) by field, the caller's leaf names, and `_array` of each traced."""
    tree = structure.treedef.unflatten([None] * len(leaves))
    paths = jtu.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)[0]
    names = [cache.path_name(path) for path, _ in paths]
    key = structure.structure_key._asdict() | structure.entry_key(leaves)._asdict()
    arrays = {names[i]: _array(leaves[i]) for i in structure.traced_indices}
    return dict(
        key=key, names=names, tree=tree, arrays=arrays, entry=entry, s=structure
    )


def _by_leaf(call: dict, field: str) -> dict:
    s, every = call["s"], range(len(call["names"]))
    indices = {"static": s.static_indices, "avals": s.rules}.get(field, every)
    return dict(zip((call["names"][i] for i in indices), call["key"][field]))


def _structure(cache, new: Any, old: Any, path: tuple | None = None):
    """How two structures differ, by key path; a Module's static fields by name."""
    if path is None:  # two calls
        new, old, path = new["tree"], old["tree"], ()
    flat = lambda t: jtu.tree_flatten_with_path(t, is_leaf=lambda x: x is not t)
    (kids, now), (old_kids, before) = flat(new), flat(old)
    if now == before:
        for (key, a), (_, b) in zip(kids, old_kids):
            yield from _structure(cache, a, b, path + key)
        return
    where = cache.path_name(path)
    name = lambda k: getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))
    keys = [{name(k) for (k,), _ in c} for c in (kids, old_kids)]
    if type(new) is type(old) and keys[0] == keys[1] and dataclasses.is_dataclass(new):
        for field, x, y in static_fields_differing(new, old):
            kind = type(new).__name__
            yield f"at {where}.{field}, {_change(x, y)} (a static field of {kind})"
        return
    why = f"new children {keys[0] - keys[1]}, gone {keys[1] - keys[0] or '{}'}"
    why = why if keys[0] != keys[1] else "the node's type or metadata differs"
    yield f"structure at {where}: {_change(now, before)}, so {why}"


def _aval(x: tuple) -> str:
    return f"{x[1]}{list(x[0])}"


def _each(field: str, show: Callable, kind: str, cache, *calls: dict) -> list:
    """A key field with an item per leaf, said by leaf (a new type by its type only)."""
    now, before = (_by_leaf(c, field) for c in calls)
    types = [_by_leaf(c, "leaf_types") for c in calls]
    same = lambda n: field == "leaf_types" or types[0][n] is types[1][n]
    return [
        f"at {n}, {_change(x, before[n], show)}{kind}"
        for n, x in now.items()
        if n in before and same(n) and not equal(x, before[n])
    ]


# How a key field is said, by its name; any other by its name alone (needs no line).
_FIELDS = {
    "treedef": _structure,
    "leaf_types": ft.partial(_each, "leaf_types", lambda t: t.__name__, " (its type)"),
    "static": ft.partial(_each, "static", _short, " (a static leaf)"),
    "avals": ft.partial(
        _each, "avals", _aval, ", which the sharding rule above it sees"
    ),
    "mesh": lambda cache, *calls: [
        "the context mesh, that bare PartitionSpecs and rules resolve against: "
        + _change(*(c["key"]["mesh"] for c in calls), show=_mesh)
    ],
}


def _key_diff(cache, new: dict, old: dict) -> list[str]:
    """Why `new` missed the entry of `old`: the key fields that differ, each once."""
    lines = []
    for field, now in new["key"].items():
        if not equal(now, before := old["key"].get(field)):
            say = f"the cache key's `{field}`: {_change(now, before)}"
            lines.extend(_FIELDS.get(field, lambda *_: [say])(cache, new, old))
    return lines


def _array_diff(cache, new: dict, old: dict) -> list[str]:
    """How the traced leaves differ in what the `jax.jit` beneath keys on."""
    return [
        f"at {name}, {what} {_change(now[what], old['arrays'][name][what], str)}"
        for name, now in new["arrays"].items()
        for what in now
        if name in old["arrays"] and now[what] != old["arrays"][name].get(what)
    ]


def _report(cache, new: dict, seen: list, head: str, diff: Callable) -> None:
    code = getattr(cache.fun_source, "__code__", None)
    where = f" defined at {code.co_filename}:{code.co_firstlineno}" if code else ""
    lines = [f"FILTER_JIT CACHE MISS at {_user_callsite()}:"]
    lines.append(f"  for {cache.fun_names[0]}{where}")
    # The closest call: of the same structure first, then with the fewest differences.
    same = lambda old: old["key"]["treedef"] == new["key"]["treedef"]
    diffs = [(not same(old), diff(cache, new, old)) for old in seen]
    if not diffs:  # (entries built with the flag off are not in `seen`)
        lines.append("  first call" + " seen with the flag on" * bool(cache.structures))
    else:
        _, closest = min(diffs, key=lambda d: (d[0], len(d[1])))
        calls = "call" if len(diffs) == 1 else "calls"
        lines.append(f"  {head}; the closest of {len(diffs)} previous {calls}:")
        lines.extend(f"  * {line}" for line in closest or ["nothing that we see"])
    logger.warning("\n".join(lines))


@contextlib.contextmanager
def _never_failing():
    try:
        yield
    except Exception as e:  # an explanation never fails a call
        logger.warning(f"FILTER_JIT CACHE MISS, not explained: {e!r}")


def miss(call) -> Callable:
    """Explains a miss of our cache (a new `jax.jit`) by `call`, and returns
    `watch(call)` for `entry.build_entry`: it records the call (its leaves as placed)
    and returns the entry's dispatch layer, `_watched`."""
    cache = call.cache
    with _never_failing():
        new = _describe(cache, call.structure, call.leaves)
        _report(cache, new, cache.seen, "a new jax.jit", _key_diff)

    def watch(call) -> Callable:
        entry = call.entry
        with contextlib.suppress(Exception):  # then "not explained" was said
            cache.seen.append(_describe(cache, entry.structure, call.leaves, entry))
        return ft.partial(_watched, entry)

    return watch


def _watched(entry, inner, call):
    """A dispatch layer (`launch.stack`): names the call to `_heard` (in a
    thread-local) while the flag is on (not for an AOT `Compiled`)."""
    __tracebackhide__ = True
    if not jax.config.jax_explain_cache_misses or call.run is not entry.jitted:
        return inner(call)
    outer, _state.call = getattr(_state, "call", None), [call.cache, entry, call.leaves]
    try:
        return inner(call)
    finally:
        _state.call = outer


def _heard(event: str, duration_secs: float, fun_name: Any = None, **_) -> None:
    """A `jax.monitoring` listener: explains a compile without a trace (JAX explains
    those) of `jit(<name>)`, the `jax.jit` of the call that `miss`'s layer names."""
    call = getattr(_state, "call", None)
    name = call and call[0].fun_names[0]
    if call and event == _TRACE and fun_name == name:
        call.append(True)
    if not call or event != _COMPILE or fun_name != f"jit({name})":
        return  # e.g. JAX's own `jax.jit`s, that place the inputs
    cache, entry, leaves, *retraced = call
    with _never_failing():
        new = _describe(cache, entry.structure, leaves, entry)
        same = [old for old in cache.seen if old["entry"] is entry]
        if all(_array_diff(cache, new, old) for old in same):  # else its first compile
            if not retraced:
                head = "the jax.jit beneath recompiles without retracing"
                _report(cache, new, same, head, _array_diff)
            cache.seen.append(new)


# One listener for the process: it does nothing outside a call that `miss` names.
jax.monitoring.register_event_duration_secs_listener(_heard)
