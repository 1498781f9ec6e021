"""Host callbacks in `filter_jit`. Equinox's runtime errors raise from a callback;
under SPMD the other partitions then wait in a collective until XLA aborts. So an entry
with callbacks runs a jitted rewrite (`Guards`) in which each callback records its
exception and returns zeros, and the first exception is raised after (`waiting`)."""

import logging
import threading
from collections.abc import Callable
from typing import Any

import equinox as eqx

# Equinox's only channel for `eqx.error_if`'s message and stack (it has no public one):
# `last_error_info` and `_on_error_msg`, read here and nowhere else.
import equinox._jit as eqx_jit
import jax
import jax._src.traceback_util as traceback_util
import jax.extend.core as jc
import jax.tree_util as jtu
import numpy as np
from jax.experimental.layout import Layout

from .._arrays import is_tracer


traceback_util.register_exclusion(__file__)

_JaxRuntimeError = jax.errors.JaxRuntimeError


def has_callback(jaxpr: Any) -> bool:
    """Whether a jaxpr, or any jaxpr nested in its equations, contains a callback."""
    for eqn in jaxpr.eqns:
        if "callback" in eqn.primitive.name:
            return True
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns") and has_callback(inner):
                    return True
    return False


class _Record:
    """The first exception of one execution's callbacks, and Equinox's info."""

    __slots__ = ("lock", "error", "info")

    def __init__(self):
        self.lock = threading.Lock()  # Callbacks may run on several devices at once.
        self.error: BaseException | None = None
        self.info: Any = None


class _Guarded:
    """A callback that never raises: see the module's docstring."""

    __slots__ = ("callback", "avals", "record")

    def __init__(self, callback: Callable, avals, record: _Record):
        self.callback = callback
        self.avals = avals
        self.record = record

    def __call__(self, *args):
        record = self.record
        # Skipped after an error: Equinox's second callback (for TPUs) calls `input()`.
        if record.error is None:
            try:
                return self.callback(*args)
            except Exception as e:
                info = getattr(eqx_jit, "last_error_info", None)
                with record.lock:
                    if record.error is None:
                        record.error, record.info = e, info
        return [np.zeros(a.shape, a.dtype) for a in self.avals]


def _rewrite(jaxpr: jc.Jaxpr, record: _Record) -> jc.Jaxpr:
    """`jaxpr` with every callback guarded, nested jaxprs included."""
    eqns = []
    changed = False
    for eqn in jaxpr.eqns:
        new = {}
        for name, value in eqn.params.items():
            rewritten = _rewrite_param(value, record)
            if rewritten is not value:
                new[name] = rewritten
        if "callback" in eqn.params and "result_avals" in eqn.params:
            avals = eqn.params["result_avals"]
            new["callback"] = _Guarded(eqn.params["callback"], avals, record)
        if new:
            eqn = eqn.replace(params={**eqn.params, **new})
            changed = True
        eqns.append(eqn)
    return jaxpr.replace(eqns=eqns) if changed else jaxpr


def _rewrite_param(value, record: _Record):
    if isinstance(value, jc.ClosedJaxpr):  # pyright: ignore[reportPrivateImportUsage]
        inner = _rewrite(value.jaxpr, record)
        return value if inner is value.jaxpr else value.replace(jaxpr=inner)
    if isinstance(value, jc.Jaxpr):
        return _rewrite(value, record)
    if isinstance(value, tuple):
        items = tuple(_rewrite_param(v, record) for v in value)
        return value if all(a is b for a, b in zip(items, value)) else items
    return value


def _runs_now() -> bool:
    """Whether a call made here executes now: not staged, transformed or disabled."""
    if jax.config.jax_disable_jit:
        return False
    # Only JAX's top-level trace executes; its class is private, so named here only.
    return type(jc.find_top_trace(())).__name__ == "EvalTrace"


def _own_layouts(jaxpr: jc.Jaxpr) -> jc.Jaxpr:
    """`Layout.AUTO` in `in_layouts` as the argument's own: calls pass arguments placed
    as the executable wants, which `jax.jit` refuses for `Layout.AUTO` itself."""
    eqns = []
    for eqn in jaxpr.eqns:
        layouts = eqn.params.get("in_layouts")
        if layouts is not None and any(x is Layout.AUTO for x in layouts):
            layouts = tuple(None if x is Layout.AUTO else x for x in layouts)
            eqn = eqn.replace(params={**eqn.params, "in_layouts": layouts})
        eqns.append(eqn)
    return jaxpr.replace(eqns=eqns)


class Guards:
    """The guarded program of one entry: a `jax.jit` that traces the entry's `jax.jit`,
    guards its callbacks and runs it inline, so JAX's cache keys it on all it depends
    on. It donates what the entry donates: a nested `jit` donates nothing."""

    def __init__(self, jitted, donate_argnums: tuple):
        self.inner = jitted
        self.record = _Record()
        # One execution at a time: a callback cannot tell which one it belongs to.
        self.lock = threading.Lock()
        self.jitted = jax.jit(self._guarded, donate_argnums=donate_argnums)

    def _guarded(self, *dynamic):
        closed, shape = jax.make_jaxpr(self.inner, return_shape=True)(*dynamic)
        jaxpr = _own_layouts(_rewrite(closed.jaxpr, self.record))
        out = jc.jaxpr_as_fun(closed.replace(jaxpr=jaxpr))(*jtu.tree_leaves(dynamic))
        return jtu.tree_unflatten(jtu.tree_structure(shape), out)

    def __call__(
        self, dispatch: Callable, program: Callable | None = None
    ) -> tuple[Any, BaseException | None, Any]:
        """`dispatch(program or self.jitted)`, waited for: `(out, None, None)`, or
        `(None, error, info)` if a callback raised."""
        with self.lock:
            record = self.record
            record.error = record.info = None
            try:
                out = dispatch(self.jitted if program is None else program)
                # The callbacks have run once the outputs are ready.
                leaves = jax.block_until_ready(jtu.tree_leaves(out))
                if not leaves:
                    jax.effects_barrier()
            finally:
                error, info = record.error, record.info
                record.error = record.info = None
        if error is not None:
            return None, error, info
        return out, None, None


class _FilterCallback(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            record.name == "jax._src.callback"
            and record.getMessage() == "jax.pure_callback failed"
        )


def _equinox_runtime_error(
    e: BaseException, jit_id: bytes, info: Any = None
) -> Exception | None:
    """Equinox's error for `e` if it is (XLA's wrapping of) Equinox's internal one."""
    if info is None:
        info = getattr(eqx_jit, "last_error_info", None)
        if info is None or "_EquinoxRuntimeError: " not in str(e):
            return None
    elif type(e).__name__ != "_EquinoxRuntimeError":
        return None
    msg, stack = info
    pieces = []
    for id_or_str in stack:
        if type(id_or_str) is str:
            pieces.append(id_or_str)
        elif id_or_str == jit_id:
            break
    return eqx.EquinoxRuntimeError(
        eqx_jit._on_error_msg.format(msg=msg, stack="".join(reversed(pieces)))
    )


def waiting(guards: Guards, inner: Callable, run, dynamic, deleted, leaves, jit_id):
    """The dispatch layer of an entry with callbacks: `inner` launches the guarded
    program; this waits for it and raises what its callbacks raised."""
    __tracebackhide__ = True
    if not _usable(dynamic):
        return _traced(inner, run, dynamic, deleted, leaves, jit_id)
    run_inner = lambda launch: inner(launch, dynamic, deleted, leaves, jit_id)
    # A `Compiled`'s executable is of the guarded program (`Lowered` lowers that).
    compiled = run if isinstance(run, jax.stages.Compiled) else None
    out, error, info = guards(run_inner, compiled)
    if error is None:
        return out
    equinox_error = _equinox_runtime_error(error, jit_id, info)
    if equinox_error is not None:
        raise equinox_error from None
    raise _JaxRuntimeError(
        f"A callback raised {type(error).__name__}: {error}"
    ) from error


def _usable(dynamic) -> bool:
    """Whether the guarded program would run now (else an outer call guards)."""
    return _runs_now() and not any(map(is_tracer, jtu.tree_leaves(dynamic)))


def _traced(inner, run, dynamic, deleted, leaves, jit_id):
    """A call staged, transformed or under `jax.disable_jit`: callbacks raise."""
    __tracebackhide__ = True
    callback_logger = logging.getLogger("jax._src.callback")
    log_filter = _FilterCallback()
    callback_logger.addFilter(log_filter)
    try:
        out = inner(run, dynamic, deleted, leaves, jit_id)
        jax.block_until_ready(out[0])
        return out
    except (_JaxRuntimeError, ValueError) as e:
        error = _equinox_runtime_error(e, jit_id)
        if error is None:
            raise
        raise error from None
    finally:
        callback_logger.removeFilter(log_filter)
