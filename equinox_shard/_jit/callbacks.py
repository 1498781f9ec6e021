"""Host callbacks in `filter_jit`. Equinox's runtime errors raise from a callback;
under SPMD the other partitions then wait in a collective until XLA aborts. So an entry
with callbacks runs a jitted rewrite (`Guards`) in which each callback records its
exception and returns zeros, and the first exception is raised after the call."""

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


def _rewrite(jaxpr: jc.Jaxpr, guard: Callable) -> jc.Jaxpr:
    """`jaxpr` with every callback guarded (`guard(callback, result_avals)`), nested
    jaxprs included."""
    eqns = []
    changed = False
    for eqn in jaxpr.eqns:
        new = {}
        for name, value in eqn.params.items():
            rewritten = _rewrite_param(value, guard)
            if rewritten is not value:
                new[name] = rewritten
        if "callback" in eqn.params and "result_avals" in eqn.params:
            avals = eqn.params["result_avals"]
            new["callback"] = guard(eqn.params["callback"], avals)
        # `Layout.AUTO` as the argument's own, which calls pass as placed for it.
        layouts = eqn.params.get("in_layouts")
        if layouts is not None and any(x is Layout.AUTO for x in layouts):
            new["in_layouts"] = tuple(None if x is Layout.AUTO else x for x in layouts)
        if new:
            eqn = eqn.replace(params={**eqn.params, **new})
            changed = True
        eqns.append(eqn)
    return jaxpr.replace(eqns=eqns) if changed else jaxpr


def _rewrite_param(value, guard: Callable):
    if isinstance(value, jc.ClosedJaxpr):  # pyright: ignore[reportPrivateImportUsage]
        inner = _rewrite(value.jaxpr, guard)
        return value if inner is value.jaxpr else value.replace(jaxpr=inner)
    if isinstance(value, jc.Jaxpr):
        return _rewrite(value, guard)
    if isinstance(value, tuple):
        items = tuple(_rewrite_param(v, guard) for v in value)
        return value if all(a is b for a, b in zip(items, value)) else items
    return value


class Guards:
    """The guarded program of one entry: a `jax.jit` that traces the entry's `jax.jit`,
    guards its callbacks and runs it inline, so JAX's cache keys it on all it depends
    on. It donates what the entry donates: a nested `jit` donates nothing."""

    def __init__(self, jitted, donate_argnums: tuple):
        self.inner = jitted
        # The first exception of the execution running, and Equinox's info for it.
        self.error: BaseException | None = None
        self.info: Any = None
        self.record_lock = threading.Lock()  # Callbacks may run on several devices.
        # One execution at a time: a callback cannot tell which one it belongs to.
        self.lock = threading.Lock()
        self.jitted = jax.jit(self._guarded, donate_argnums=donate_argnums)

    def _guard(self, callback: Callable, avals) -> Callable:
        """`callback` made never to raise: see the module's docstring."""

        def guarded(*args):
            # Skipped after an error: Equinox's second callback (TPUs) calls `input()`.
            if self.error is None:
                try:
                    return callback(*args)
                except Exception as e:
                    # Equinox's `(message, stack)` if `e` is its internal error.
                    ours = type(e).__name__ == "_EquinoxRuntimeError"
                    info = getattr(eqx_jit, "last_error_info", None) if ours else None
                    with self.record_lock:
                        if self.error is None:
                            self.error, self.info = e, info
            return [np.zeros(a.shape, a.dtype) for a in avals]

        return guarded

    def _guarded(self, *dynamic):
        closed, shape = jax.make_jaxpr(self.inner, return_shape=True)(*dynamic)
        jaxpr = _rewrite(closed.jaxpr, self._guard)
        out = jc.jaxpr_as_fun(closed.replace(jaxpr=jaxpr))(*jtu.tree_leaves(dynamic))
        return jtu.tree_unflatten(jtu.tree_structure(shape), out)

    def __call__(self, inner: Callable, call):
        """`inner(call)` launching the guarded program (unless `call.run` is an
        executable of it already), waited for; raises what a callback raised."""
        __tracebackhide__ = True
        if not isinstance(call.run, jax.stages.Compiled):
            call.run = self.jitted
        with self.lock:
            self.error = self.info = None
            try:
                out = inner(call)
                # The callbacks have run once the outputs are ready.
                if not jax.block_until_ready(jtu.tree_leaves(out)):
                    jax.effects_barrier()
            finally:
                error, info = self.error, self.info
                self.error = self.info = None
        if error is None:
            return out
        if info is not None:
            raise _equinox_runtime_error(info, call.jit_id) from None
        raise _JaxRuntimeError(
            f"A callback raised {type(error).__name__}: {error}"
        ) from error


def _equinox_runtime_error(info: tuple, jit_id: bytes) -> Exception:
    """Equinox's error from its `(message, stack)`, the stack cut at our call, as
    `eqx.filter_jit` builds it."""
    msg, stack = info  # the stack: its frames (`str`), and each jit's id (`bytes`)
    if jit_id in stack:
        stack = stack[: stack.index(jit_id)]
    frames = "".join(reversed([x for x in stack if type(x) is str]))
    return eqx.EquinoxRuntimeError(eqx_jit._on_error_msg.format(msg=msg, stack=frames))


def _runs_now(dynamic) -> bool:
    """Whether a call made here executes now: not staged, transformed or disabled."""
    if jax.config.jax_disable_jit or any(map(is_tracer, jtu.tree_leaves(dynamic))):
        return False
    # Only JAX's top-level trace executes; its class is private, so named here only.
    return type(jc.find_top_trace(())).__name__ == "EvalTrace"


def waiting(guards: Guards, inner: Callable, call):
    """The dispatch layer of an entry with callbacks: `inner` launches the guarded
    program, which `guards` waits for (a `Compiled`'s executable is of it already)."""
    __tracebackhide__ = True
    if _runs_now(call.dynamic):
        return guards(inner, call)
    # Else callbacks raise here, as in `eqx.filter_jit` (Equinox's error rebuilt).
    before = getattr(eqx_jit, "last_error_info", None)
    quiet = lambda record: record.getMessage() != "jax.pure_callback failed"
    callback_logger = logging.getLogger("jax._src.callback")
    callback_logger.addFilter(quiet)
    try:
        out = inner(call)
        jax.block_until_ready(out[0])
        return out
    except (_JaxRuntimeError, ValueError):
        info = getattr(eqx_jit, "last_error_info", None)
        if info is None or info is before:  # not Equinox's error
            raise
        raise _equinox_runtime_error(info, call.jit_id) from None
    finally:
        callback_logger.removeFilter(quiet)
