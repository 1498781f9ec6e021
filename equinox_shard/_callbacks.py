"""Waiting for host callbacks, and Equinox's runtime errors (`eqx.error_if`).

JAX dispatches asynchronously: a call returns before its computation has run. Equinox's
runtime errors are host callbacks that raise, so a function that contains a callback is
waited for, and the error it raised is re-raised as `eqx.EquinoxRuntimeError` with
Equinox's message. Functions without a callback keep asynchronous dispatch.
"""

import logging
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax


try:
    _JaxRuntimeError = jax.errors.JaxRuntimeError  # pyright: ignore
except AttributeError:  # pragma: no cover
    _JaxRuntimeError = RuntimeError


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


class _FilterCallback(logging.Filterer):
    def filter(self, record: logging.LogRecord):  # pyright: ignore
        return not (
            record.name == "jax._src.callback"
            and record.getMessage() == "jax.pure_callback failed"
        )


def _equinox_runtime_error(e: Exception, jit_id: bytes) -> Exception | None:
    import equinox._jit as eqx_jit  # Equinox's runtime-error channel.

    info = getattr(eqx_jit, "last_error_info", None)
    if info is None or "_EquinoxRuntimeError: " not in str(e):
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


def call_and_wait(call: Callable[[], Any], jit_id: bytes) -> Any:
    """Calls `call()` and waits for its outputs; an Equinox runtime error raised by a
    callback inside is re-raised as `eqx.EquinoxRuntimeError`."""
    __tracebackhide__ = True
    callback_logger = logging.getLogger("jax._src.callback")
    log_filter = _FilterCallback()
    callback_logger.addFilter(log_filter)
    try:
        out = call()
        jax.block_until_ready(out)
        return out
    except (_JaxRuntimeError, ValueError) as e:
        error = _equinox_runtime_error(e, jit_id)
        if error is None:
            raise
        raise error from None
    finally:
        callback_logger.removeFilter(log_filter)
