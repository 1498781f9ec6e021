"""`jax.config.update("jax_explain_cache_misses", True)` for `filter_jit`: each miss of
our cache (a new entry, so a new `jax.jit`) is explained on the `equinox_shard` logger,
at the caller's line, in the caller's argument names, against the closest call seen
before. Beneath an entry, a retrace of its `jax.jit` (shape, dtype, memory kind) is
JAX's own report, as JAX writes it; a recompile without a retrace (a sharding,
committedness), which JAX does not explain, is ours again, heard through
`jax.monitoring`. Nothing of it runs with the flag off (RFC §13)."""

import contextlib
import dataclasses
import functools as ft
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import equinox
import jax
import jax._src.traceback_util as traceback_util
import jax.tree_util as jtu
import jaxtyping

from .._arrays import is_concrete
from .cache import path_name
from .launch import stack


traceback_util.register_exclusion(__file__)


logger = logging.getLogger("equinox_shard")

# Frames that are not the caller's: ours, JAX's, and the wrappers between.
_NOT_USER = tuple(
    os.path.dirname(os.path.abspath(str(m.__file__))) + os.sep
    for m in (jax, equinox, jaxtyping, logging, sys.modules[__package__])
) + (contextlib.__file__, ft.__file__)
# `jax.monitoring` events (the same in JAX 0.10.2 and 0.12): a `jax.jit` traced, with
# `fun_name` the function's name, and compiled, with `fun_name` `jit(<name>)`.
_TRACE = "/jax/core/compile/jaxpr_trace_duration"
_COMPILE = "/jax/core/compile/backend_compile_duration"
_state = threading.local()  # `.call`: the call `_watched` dispatches, for `_heard`
_lock, _listening = threading.Lock(), []


def _user_callsite() -> str:
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_NOT_USER):
        frame = frame.f_back
    if frame is None:
        return "<unknown>"
    return f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})"


def _short(x: Any, limit: int = 120) -> str:
    text = repr(x)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:
        return a is b


def _mesh(mesh) -> str:
    if mesh is None:
        return "no mesh"
    types = ", ".join(getattr(t, "name", str(t)) for t in mesh.axis_types)
    return f"{type(mesh).__name__}({dict(mesh.shape)}, axis_types=({types}))"


def _array(x) -> dict:
    """What the `jax.jit` beneath keys on, of one traced leaf."""
    try:
        out: dict = {"type": jax.typeof(x).str_short(short_dtypes=True)}
    except Exception:  # e.g. a `ShapeDtypeStruct`, for `.lower`
        out = {"type": f"{getattr(x, 'dtype', '?')}{list(getattr(x, 'shape', ()))}"}
    if is_concrete(x):
        s = x.sharding
        named = isinstance(s, jax.sharding.NamedSharding)
        out["sharding"] = f"NamedSharding({_mesh(s.mesh)}, {s.spec})" if named else s
        out["memory kind"] = getattr(s, "memory_kind", None)
        out["committed"] = x.committed
    return out


def _describe(cache, structure, leaves: list, entry=None) -> dict:
    """A call, as explanations compare it: its two cache keys field by field
    (`cache.StructureKey`, then `cache.EntryKey`), the caller's name of each leaf, and
    what the `jax.jit` beneath keys on of each traced leaf (`_array`)."""
    paths = jtu.tree_flatten_with_path(structure.treedef.unflatten(leaves))[0]
    names = [path_name(cache.names, path, cache.var_name) for path, _ in paths]
    key = structure.structure_key._asdict() | structure.entry_key(leaves)._asdict()
    arrays = {names[i]: _array(leaves[i]) for i in structure.dynamic}
    return dict(key=key, names=names, structure=structure, arrays=arrays, entry=entry)


def _by_leaf(call: dict, field: str) -> dict:
    """A key field that holds one item per leaf (of some leaves), by leaf name."""
    s, every = call["structure"], range(len(call["names"]))
    indices = {"static": s.static, "avals": s.rules}.get(field, every)
    return dict(zip((call["names"][i] for i in indices), call["key"][field]))


def _structure(cache, new: Any, old: Any, path: tuple = ()):
    """How two structures differ, one level at a time, by the caller's key path; a
    Module's static fields by name."""
    flat = lambda t: jtu.tree_flatten_with_path(t, is_leaf=lambda x: x is not t)
    (kids, now), (old_kids, before) = flat(new), flat(old)
    if now == before:
        for (key, a), (_, b) in zip(kids, old_kids):
            yield from _structure(cache, a, b, path + key)
        return
    where = path_name(cache.names, path, cache.var_name)
    name = lambda k: getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))
    keys = [{name(k) for (k,), _ in c} for c in (kids, old_kids)]
    if type(new) is type(old) and keys[0] == keys[1] and dataclasses.is_dataclass(new):
        for f in dataclasses.fields(new):
            x, y = getattr(new, f.name, None), getattr(old, f.name, None)
            if f.metadata.get("static", False) and not _equal(x, y):
                kind = f"(a static field of {type(new).__name__})"
                yield f"at {where}.{f.name}, now {_short(x)} and before {_short(y)} {kind}"
        return
    why = f"new children {keys[0] - keys[1]}, gone {keys[1] - keys[0] or '{}'}"
    why = "the node's metadata differs" if keys[0] == keys[1] else why
    why = "the node type differs" if type(new) is not type(old) else why
    yield f"structure at {where}: now {_short(now)} and before {_short(before)}, so {why}"


def _per_leaf(field: str, show: Callable, kind: str) -> Callable:
    """How a key field with an item per leaf differs, by leaf; a leaf whose type
    changed is said once, by its type."""

    def lines(cache, *calls: dict) -> list[str]:
        (now, before), types = (
            [_by_leaf(c, f) for c in calls] for f in (field, "leaf_types")
        )
        same = lambda n: field == "leaf_types" or types[0][n] is types[1][n]
        return [
            f"at {n}, now {show(x)} and before {show(before[n])}{kind}"
            for n, x in now.items()
            if n in before and same(n) and not _equal(x, before[n])
        ]

    return lines


# How a field of the cache keys that differs is said, by the field's name; any other
# field is said by its name alone, so a new field is explained without a line here.
_FIELDS = {
    "treedef": lambda cache, *calls: list(
        _structure(
            cache,
            *(c["key"]["treedef"].unflatten([None] * len(c["names"])) for c in calls),
        )
    ),
    "leaf_types": _per_leaf("leaf_types", lambda t: t.__name__, " (the leaf's type)"),
    "static": _per_leaf("static", _short, " (a static leaf)"),
    "avals": _per_leaf(
        "avals",
        lambda x: f"{x[1]}{list(x[0])}",
        ", which the sharding rule above it sees",
    ),
    "mesh": lambda cache, *calls: [
        "the context mesh, that bare PartitionSpecs and rules resolve against: "
        "now {} and before {}".format(*(_mesh(c["key"]["mesh"]) for c in calls))
    ],
}


def _key_diff(cache, new: dict, old: dict) -> list[str]:
    """Why `new` missed the entry of `old`: the fields of the cache keys that differ,
    in the keys' order, each said once."""
    lines = []
    for field, now in new["key"].items():
        if not _equal(now, before := old["key"].get(field)):
            say = f"the cache key's `{field}`: now {_short(now)} and before {_short(before)}"
            lines.extend(_FIELDS.get(field, lambda *_: [say])(cache, new, old))
    return lines


def _array_diff(cache, new: dict, old: dict) -> list[str]:
    """How the traced leaves differ in what the `jax.jit` beneath keys on."""
    return [
        f"at {name}, {what} now {now[what]} and before {old['arrays'][name][what]}"
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
        lines.append(
            "  first call seen with the flag on" if cache.structures else "  first call"
        )
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


def build(cache, structure, args, kwargs, leaves, make: Callable[[], tuple]) -> tuple:
    """`make()` (which builds and traces a new entry: `entry.build_entry`) under the
    flag: explains the miss first, then records the call (with the leaves as `jax.jit`
    gets them). The entry gets one more dispatch layer: while the flag is on, its call
    is known to `_heard` (in a thread-local; no frame is read)."""
    with _never_failing():
        new = _describe(cache, structure, leaves)
        _report(cache, new, cache.seen, "a new jax.jit", _key_diff)
    entry, leaves, trees = make()
    with contextlib.suppress(Exception):  # then "not explained" was said
        cache.seen.append(_describe(cache, entry.structure, leaves, entry))
    with _lock:  # one listener for the process, from the first miss explained on
        if not _listening:
            jax.monitoring.register_event_duration_secs_listener(_heard)
            _listening.append(_heard)

    def watched(dispatch: Callable) -> Callable:
        def watched(run, dynamic, deleted, leaves, jit_id):
            __tracebackhide__ = True
            flag = jax.config.jax_explain_cache_misses  # pyright: ignore
            if not flag or run is not entry.jitted:  # off, or an AOT `Compiled`
                return dispatch(run, dynamic, deleted, leaves, jit_id)
            outer, _state.call = getattr(_state, "call", None), [cache, entry, leaves]
            try:
                return dispatch(run, dynamic, deleted, leaves, jit_id)
            finally:
                _state.call = outer

        return watched

    entry.dispatch = stack(entry.launch, (*entry.layers, watched))
    return entry, leaves, trees


def _heard(event: str, duration: float, fun_name: Any = None, **_) -> None:
    """A `jax.monitoring` listener. In a call that `build`'s layer names, a trace of the
    entry's `jax.jit` is JAX's to explain (it does); a compile without one (a call that
    found its entry) is explained here, against the calls this entry has seen."""
    cache, entry, leaves, *traced = call = getattr(_state, "call", None) or [None] * 3
    if cache is not None and event == _TRACE and fun_name == cache.fun_names[0]:
        call.append(True)
    elif (
        cache is not None
        and event == _COMPILE
        and fun_name == f"jit({cache.fun_names[0]})"
    ):
        with _never_failing():  # (not JAX's own `jax.jit`s, that place the inputs)
            new = _describe(cache, entry.structure, leaves, entry)
            same = [old for old in cache.seen if old["entry"] is entry]
            if all(
                _array_diff(cache, new, old) for old in same
            ):  # else its first compile
                if not traced:  # else a retrace, that JAX explained
                    head = "the jax.jit beneath recompiles without retracing"
                    _report(cache, new, same, head, _array_diff)
                cache.seen.append(new)
