"""`jax.config.update("jax_explain_cache_misses", True)` for `filter_jit`: each miss of
our cache (a new entry, so a new `jax.jit`) is explained on the `equinox_shard` logger,
at the caller's line, in the caller's argument names, against the closest call seen
before; the `jax.jit` beneath keeps explaining its own misses (shape, dtype, sharding),
pointed at the caller's line instead of our modules, and without its wrong "never seen
function" for an entry we just explained. All of it runs on a miss, or on a call of
an entry built under the flag while the flag is on; JAX's loggers are put back as they
were after each (RFC §13)."""

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

from ._arrays import is_concrete
from ._cache import path_name
from ._launch import stack


traceback_util.register_exclusion(__file__)


logger = logging.getLogger("equinox_shard")

_HERE = os.path.dirname(os.path.abspath(__file__))
# Frames that are not the caller's: ours, JAX's, and the wrappers between.
_NOT_USER = tuple(
    os.path.dirname(os.path.abspath(str(m.__file__))) + os.sep
    for m in (jax, equinox, jaxtyping, logging)
) + (_HERE + os.sep, str(contextlib.__file__), str(ft.__file__))
# JAX's own explanations of its tracing cache misses are logged here, on both versions.
_JAX_LOGGER = "jax._src.interpreters.partial_eval"
# JAX logs "Compiling ..." here when it lowers again (at DEBUG unless `log_compiles`).
_JAX_LOWERING_LOGGER = "jax._src.interpreters.pxla"


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


def _mesh(mesh) -> str:
    if mesh is None:
        return "no mesh"
    types = ", ".join(getattr(t, "name", str(t)) for t in mesh.axis_types)
    return f"{type(mesh).__name__}({dict(mesh.shape)}, axis_types=({types}))"


def _sharding(s) -> str:
    if isinstance(s, jax.sharding.NamedSharding):
        return f"NamedSharding({_mesh(s.mesh)}, {s.spec})"
    return _short(s, 200)


def _array(x) -> dict:
    """What the `jax.jit` beneath keys on, of one traced leaf."""
    try:
        out: dict = {"type": jax.typeof(x).str_short(short_dtypes=True)}
    except Exception:  # e.g. a `ShapeDtypeStruct`, for `.lower`
        out = {"type": f"{getattr(x, 'dtype', '?')}{list(getattr(x, 'shape', ()))}"}
    sharding = getattr(x, "sharding", None)
    if is_concrete(x):
        out["sharding"] = _sharding(sharding)
        out["memory kind"] = getattr(sharding, "memory_kind", None)
        out["committed"] = x.committed
    return out


def _describe(cache, structure, args, kwargs, leaves) -> dict:
    """A call, as explanations compare it: its two cache keys field by field
    (`_cache.StructureKey`, then `_cache.EntryKey`), the caller's name of each leaf,
    and what the `jax.jit` beneath keys on of each traced leaf (`_array`)."""
    flat, _ = jtu.tree_flatten_with_path((args, kwargs))
    names = [path_name(cache.names, path, cache.var_name) for path, _ in flat]
    key = structure.structure_key._asdict() | structure.entry_key(leaves)._asdict()
    arrays = {names[i]: _array(leaves[i]) for i in structure.dynamic}
    return {"key": key, "names": names, "structure": structure, "arrays": arrays}


def _per_leaf(call: dict, field: str) -> dict:
    """A key field that holds one item per leaf (of some leaves), by leaf name."""
    structure = call["structure"]
    indices = {"static": structure.static, "avals": structure.rules}.get(
        field, range(len(call["names"]))
    )
    return dict(zip((call["names"][i] for i in indices), call["key"][field]))


def _node(tree: Any, path: tuple) -> Any:
    for key in path:
        attr = isinstance(key, jtu.GetAttrKey)
        tree = getattr(tree, key.name) if attr else tree[getattr(key, "idx", None)]
    return tree


def _key(path: tuple) -> Any:
    (key,) = path
    return getattr(key, "key", getattr(key, "name", getattr(key, "idx", key)))


def _children(tree: Any) -> tuple[list, Any]:
    return jtu.tree_flatten_with_path(tree, is_leaf=lambda x: x is not tree)


def _differences(new: Any, old: Any, path: tuple = ()):
    """`(path, now, before, why)` where two trees first differ, one level at a time."""
    (new_children, new_def), (old_children, old_def) = _children(new), _children(old)
    if new_def == old_def:
        for (key, a), (_, b) in zip(new_children, old_children):
            yield from _differences(a, b, path + key)
        return
    if type(new) is not type(old):
        why = "the node type differs"
    elif [k for k, _ in new_children] != [k for k, _ in old_children]:
        names = [{_key(k) for k, _ in c} for c in (new_children, old_children)]
        why = f"new children {names[0] - names[1]}, gone {names[1] - names[0] or '{}'}"
    else:
        why = "the node's metadata differs"
    yield path, new_def, old_def, why


def _structure(cache, new_def, old_def) -> list[str]:
    """How two structures differ, by key path; a Module's static fields by name."""
    lines = []
    new, old = (d.unflatten([None] * d.num_leaves) for d in (new_def, old_def))
    for path, now, before, why in _differences(new, old):
        where = path_name(cache.names, tuple(path), cache.var_name)
        if "metadata" in why:
            a, b = (_node(t, tuple(path)) for t in (new, old))
            if type(a) is type(b) and dataclasses.is_dataclass(a):
                for f in dataclasses.fields(a):
                    x, y = getattr(a, f.name, None), getattr(b, f.name, None)
                    if f.metadata.get("static", False) and x != y:
                        lines.append(
                            f"at {where}.{f.name}, now {_short(x)} and before "
                            f"{_short(y)} (a static field of {type(a).__name__})"
                        )
                continue
        lines.append(
            f"structure at {where}: now {_short(now)} and before {_short(before)}, "
            f"so {why}"
        )
    return lines


def _leaf(call: dict, name: str) -> str:
    static = _per_leaf(call, "static")
    if name in static:
        return f"{_short(static[name])} (a static leaf)"
    return f"an array ({_per_leaf(call, 'leaf_types')[name].__name__})"


def _treedef(cache, new: dict, old: dict) -> list[str]:
    return _structure(cache, new["key"]["treedef"], old["key"]["treedef"])


def _leaf_types(cache, new: dict, old: dict) -> list[str]:
    now, before = _per_leaf(new, "leaf_types"), _per_leaf(old, "leaf_types")
    return [
        f"at {name}, now {_leaf(new, name)} and before {_leaf(old, name)}"
        for name, t in now.items()
        if before.get(name, t) is not t
    ]


def _dynamic(cache, new: dict, old: dict) -> list[str]:
    now, before = (getattr(c["key"]["dynamic"], "__name__", "?") for c in (new, old))
    return [f"the leaves traced: now those of `{now}` and before those of `{before}`"]


def _static(cache, new: dict, old: dict) -> list[str]:
    now, before = _per_leaf(new, "static"), _per_leaf(old, "static")
    types = _per_leaf(new, "leaf_types"), _per_leaf(old, "leaf_types")
    return [
        f"at {name}, now {_short(x)} and before {_short(before[name])} (a static leaf)"
        for name, x in now.items()
        if name in before
        and types[0][name] is types[1][name]  # else `_leaf_types` says it
        and not _equal(x, before[name])
    ]


def _avals(cache, new: dict, old: dict) -> list[str]:
    now, before = _per_leaf(new, "avals"), _per_leaf(old, "avals")
    aval = lambda x: f"{x[1]}{list(x[0])}"
    return [
        f"at {name}, now {aval(x)} and before {aval(before[name])}, which the "
        "sharding rule above it sees"
        for name, x in now.items()
        if name in before and x != before[name]
    ]


def _context_mesh(cache, new: dict, old: dict) -> list[str]:
    return [
        "the context mesh, that bare PartitionSpecs and rules resolve against: "
        f"now {_mesh(new['key']['mesh'])} and before {_mesh(old['key']['mesh'])}"
    ]


# How a field of the cache keys that differs is said, by the field's name; any other
# field is said by its name alone, so a new field is explained without a line here.
_FIELDS = {
    "treedef": _treedef,
    "leaf_types": _leaf_types,
    "dynamic": _dynamic,
    "static": _static,
    "avals": _avals,
    "mesh": _context_mesh,
}


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:
        return a is b


def _key_diff(cache, new: dict, old: dict) -> list[str]:
    """Why `new` missed the entry of `old`: the fields of the cache keys that differ,
    in the keys' order, each said once."""
    lines = []
    for field, now in new["key"].items():
        before = old["key"].get(field)
        if _equal(now, before):
            continue
        say = _FIELDS.get(field)
        if say is None:
            lines.append(
                f"the cache key's `{field}`: now {_short(now)} and before "
                f"{_short(before)}"
            )
        else:
            lines.extend(say(cache, new, old))
    return lines


def _array_diff(cache, new: dict, old: dict) -> list[str]:
    """How the traced leaves differ in what the `jax.jit` beneath keys on, for a call
    that found its entry."""
    del cache
    lines = []
    for name, now in new["arrays"].items():
        before = old["arrays"].get(name, now)
        lines.extend(
            f"at {name}, {what} now {now[what]} and before {before.get(what)}"
            for what in now
            if now[what] != before.get(what)
        )
    return lines


def _report(cache, new: dict, seen: list, head: str, diff: Callable) -> str:
    code = getattr(cache.fun_source, "__code__", None)
    where = f" defined at {code.co_filename}:{code.co_firstlineno}" if code else ""
    lines = [f"FILTER_JIT CACHE MISS at {_user_callsite()}:"]
    lines.append(f"  for {cache.fun_names[0]}{where}")
    candidates = [
        (len(d) + 1000 * (old["key"]["treedef"] != new["key"]["treedef"]), d)
        for old in seen
        for d in [diff(cache, new, old)]
    ]
    if not candidates:
        lines.append("  first call")
    else:
        _, closest = min(candidates, key=lambda c: c[0])
        calls = "call" if len(candidates) == 1 else "calls"
        lines.append(f"  {head}; the closest of {len(candidates)} previous {calls}:")
        lines.extend(f"  * {line}" for line in closest or ["nothing that we see"])
    return "\n".join(lines)


def build(cache, structure, args, kwargs, leaves, make: Callable[[], tuple]) -> tuple:
    """`make()` (which builds and traces a new entry: `_entry.build_entry`) under the
    flag: explains the miss first, and records the call; the entry's dispatch then
    tells `_recompiled` which call it makes. Loggers are as they were afterwards."""
    with listening(), _each_report_once() as said:
        _miss(cache, structure, args, kwargs, leaves)
        outer, _state.building = getattr(_state, "building", False), True
        try:
            entry, leaves, trees, run = make()
        finally:
            _state.building = outer
        _seen(cache, entry, args, kwargs, leaves)
    watched = lambda inner: _watched(cache, entry, inner, said)
    entry.dispatch = stack(entry.launch, (*entry.layers, watched))
    return entry, leaves, trees, run


def _miss(cache, structure, args, kwargs, leaves) -> None:
    """A new entry (a new `jax.jit`) is about to be built: explains why."""
    try:
        new = _describe(cache, structure, args, kwargs, leaves)
        report = _report(cache, new, cache.seen, "a new jax.jit", _key_diff)
    except Exception as e:  # an explanation never fails a call
        report = f"FILTER_JIT CACHE MISS, not explained: {e!r}"
    if not cache.seen and cache.structures:
        report = report.replace("first call", "first call seen with the flag on")
    logger.warning(report)


def _seen(cache, entry, args, kwargs, leaves) -> None:
    """Records a call that compiled (with the leaves as `jax.jit` got them)."""
    with contextlib.suppress(Exception):  # then "not explained" was said
        new = _describe(cache, entry.structure, args, kwargs, leaves)
        new["entry"] = entry
        cache.seen.append(new)


def _watched(cache, entry, dispatch: Callable, said: set) -> Callable:
    """The dispatch layer (see `_launch.stack`) of an entry built under the flag:
    while the flag is on, `dispatch` runs with JAX's loggers listened to, and with
    this call (the entry, and the leaves as `jax.jit` gets them) known to
    `_recompiled`. The call that built the entry dispatches it first: what `build`
    said (`said`) is not said again by the first dispatch's traces
    (`_callbacks.Guards`)."""
    first = [said]

    def watched(run, dynamic, deleted, leaves, jit_id):
        __tracebackhide__ = True
        flag = jax.config.jax_explain_cache_misses  # pyright: ignore
        if not flag or run is not entry.jitted:  # off, or an AOT `Compiled`
            return dispatch(run, dynamic, deleted, leaves, jit_id)
        outer, _state.call = getattr(_state, "call", None), (cache, entry, leaves)
        try:
            with listening(), _each_report_once(first.pop() if first else None):
                return dispatch(run, dynamic, deleted, leaves, jit_id)
        finally:
            _state.call = outer

    return watched


def _recompiled(module_name) -> None:
    """JAX is compiling again beneath an entry that a call found (a hit of ours): the
    `jax.jit` was not retraced (else JAX said why), so its inputs' shardings, memory
    kinds or committedness changed. The call is the one `_watched` dispatches."""
    if getattr(_state, "building", False):
        return
    call = getattr(_state, "call", None)
    if call is None:
        return
    cache, entry, leaves = call
    if module_name != f"jit({cache.fun_names[0]})":
        return  # not our `jax.jit`: JAX's own, for placing the inputs
    args, kwargs = entry.structure.treedef.unflatten(leaves)
    explained, _state.jax_explained = getattr(_state, "jax_explained", False), False
    new = _describe(cache, entry.structure, args, kwargs, leaves)
    new["entry"] = entry
    same = [old for old in cache.seen if old.get("entry") is entry]
    if not all(_array_diff(cache, new, old) for old in same):
        return  # a call like one seen before: the entry's first compile, traced
    if not explained:
        head = "the jax.jit beneath recompiles without retracing"
        logger.warning(_report(cache, new, same, head, _array_diff))
    cache.seen.append(new)


class _JaxReports(logging.Filter):
    """On JAX's logger: its report of a `jax.jit` beneath ours names the caller's line
    instead of our module's; its "never seen function" for an entry being built is
    dropped (ours explained the miss, and each entry has its own `jax.jit`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        head, _, rest = msg.partition("\n")
        prefix = "TRACING CACHE MISS at "
        where = head[len(prefix) :]
        # An empty place: a trace nested in ours (`_callbacks.Guards`' `make_jaxpr`).
        if not (head.startswith(prefix) and (where.startswith(_HERE) or where == ":")):
            return True
        if f" defined at {_HERE}" in rest.partition("\n")[0]:
            return False  # our own `jax.jit` (`Guards`): the user's function is said
        if getattr(_state, "building", False) and "never seen function" in rest:
            return False
        record.msg = f"{prefix}{_user_callsite()}:\n{rest}"
        record.args = ()
        said = getattr(_state, "said", None)
        if said is not None:
            if record.msg in said:
                return False
            said.add(record.msg)
        _state.jax_explained = True
        return True


class _Compiles(logging.Filter):
    """On JAX's lowering logger, made to log its "Compiling" line at `DEBUG` too: the
    one sign of a recompile without a retrace. Records below the level the logger had
    before are dropped here, so that nothing more reaches any handler."""

    def __init__(self, level: int):
        super().__init__()
        self.level = level  # the logger's own level before ours, usually `NOTSET`

    def filter(self, record: logging.LogRecord) -> bool:
        flag = jax.config.jax_explain_cache_misses  # pyright: ignore
        if flag and str(record.msg).startswith("Compiling "):
            try:
                _recompiled(record.args[0] if record.args else None)  # pyright: ignore
            except Exception as e:  # an explanation never fails a call
                logger.warning(f"FILTER_JIT CACHE MISS, not explained: {e!r}")
        parent = logging.getLogger(_JAX_LOWERING_LOGGER).parent
        level = self.level or (parent.getEffectiveLevel() if parent else 0)
        return record.levelno >= level


_state = threading.local()
_reports = _JaxReports()


@contextlib.contextmanager
def _each_report_once(said: set | None = None):
    """JAX's reports of our `jax.jit` said once per call (`said`: those already said
    in this call): for an entry with callbacks it is traced twice
    (`_callbacks.Guards`), and JAX explains each trace."""
    outer, _state.said = getattr(_state, "said", None), set() if said is None else said
    try:
        yield _state.said
    finally:
        _state.said = outer


class _Listening:
    """JAX's loggers as `listening` changes them: once for every thread and nested
    call inside one, and put back as they were when the last leaves."""

    def __init__(self):
        self.lock = threading.Lock()
        self.depth = 0
        self.compiles: _Compiles | None = None
        self.level: int | None = None  # the lowering logger's level, if we changed it

    def enter(self) -> None:
        with self.lock:
            self.depth += 1
            if self.depth > 1:
                return
            logging.getLogger(_JAX_LOGGER).addFilter(_reports)
            lowering = logging.getLogger(_JAX_LOWERING_LOGGER)
            self.compiles = _Compiles(lowering.level)
            lowering.addFilter(self.compiles)
            self.level = None
            if lowering.getEffectiveLevel() > logging.DEBUG:
                self.level = lowering.level
                lowering.setLevel(logging.DEBUG)

    def exit(self) -> None:
        with self.lock:
            self.depth -= 1
            if self.depth > 0:
                return
            logging.getLogger(_JAX_LOGGER).removeFilter(_reports)
            lowering = logging.getLogger(_JAX_LOWERING_LOGGER)
            lowering.removeFilter(self.compiles)  # pyright: ignore[reportArgumentType]
            # Unless someone else set it meanwhile.
            if self.level is not None and lowering.level == logging.DEBUG:
                lowering.setLevel(self.level)
            self.compiles = self.level = None


_listening = _Listening()


@contextlib.contextmanager
def listening():
    """JAX's explanations rewritten (`_JaxReports`) and its "Compiling" lines heard
    (`_Compiles`) in the body; the loggers as they were afterwards, also on an
    error."""
    _listening.enter()
    try:
        yield
    finally:
        _listening.exit()
