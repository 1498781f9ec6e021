import os
import typing

import jax
import pytest

from . import hypothesis_profiles  # noqa: F401 - registers `--hypothesis-profile=long`
from .isolated import CPU_COMPILE_FLAGS


typing.TESTING = True  # pyright: ignore


# The devices the suite is written for: 8 simulated CPU devices. `JAX_PLATFORMS`, when
# set, picks the backend instead (`JAX_PLATFORMS=tpu,cpu`: the chip's own devices, and
# the CPU that host callbacks need), and `JAX_NUM_CPU_DEVICES` the number of CPU
# devices (`JAX_NUM_CPU_DEVICES=1` runs here what one chip runs). A test builds its
# meshes from the devices there are (`helpers.auto_mesh()`: one axis over all of
# them); one whose point needs a count says so with `@pytest.mark.devices(n, reason=)`,
# and one that relies on the CPU backend's behaviour with `@pytest.mark.cpu(reason=)`.
SUITE_DEVICES = 8
if not os.environ.get("JAX_PLATFORMS"):
    jax.config.update("jax_platforms", "cpu")
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {CPU_COMPILE_FLAGS}"
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update(
    "jax_num_cpu_devices", int(os.environ.get("JAX_NUM_CPU_DEVICES", SUITE_DEVICES))
)


@pytest.fixture
def getkey():
    # Delayed import so that jaxtyping can transform the AST of Equinox before it is
    # imported, but conftest.py is ran before then.
    import equinox.internal as eqxi

    return eqxi.GetKey()


def pytest_collection_modifyitems(config, items):
    del config
    n, backend = jax.device_count(), jax.default_backend()
    for item in items:
        if item.get_closest_marker("accelerator") is not None and backend == "cpu":
            reason = "needs an accelerator (JAX_PLATFORMS=tpu,cpu or gpu,cpu)"
            item.add_marker(pytest.mark.skip(reason=reason))
        marker = item.get_closest_marker("cpu")
        if marker is not None and backend != "cpu":
            why = marker.kwargs.get("reason")
            reason = "relies on the CPU backend" + (f": {why}" if why else "")
            item.add_marker(pytest.mark.skip(reason=f"{reason}; {backend} present"))
        marker = item.get_closest_marker("devices")
        if marker is not None and n < marker.args[0]:
            why = marker.kwargs.get("reason")
            reason = f"needs {marker.args[0]} devices" + (f": {why}" if why else "")
            reason += f"; {n} {backend} device(s) present"
            item.add_marker(pytest.mark.skip(reason=reason))


def _exceptions(error: BaseException):
    """`error`, its causes and contexts, and the members of exception groups."""
    seen, todo = set(), [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        if isinstance(e, BaseExceptionGroup):
            todo += list(e.exceptions)


def _too_few_devices(error: BaseException) -> str | None:
    """The skip reason when `error` comes from the suite wanting more devices than the
    backend has (a mesh larger than the devices, `jax.devices()[k]` past the end);
    `None` otherwise, or when all the suite's devices are present."""
    n = jax.device_count()
    if n >= SUITE_DEVICES:
        return None
    for e in _exceptions(error):
        if not isinstance(e, (ValueError, IndexError)):
            continue  # (`str` of an AssertionError may show a deleted array, and fail)
        text = str(e)
        if (isinstance(e, ValueError) and text.startswith("Number of devices")) or (
            isinstance(e, IndexError) and text == "list index out of range"
        ):
            first = text.splitlines()[0][:100]
            return (
                f"needs {SUITE_DEVICES} devices; {n} {jax.default_backend()} "
                f"device(s) present ({type(e).__name__}: {first})"
            )
    return None


# A test written for the suite's 8 devices skips, saying why, on a backend with fewer
# (one accelerator chip): decided here, from the error it raised (a mesh larger than
# the devices, `jax.devices()[k]` past the end), not from a list of tests; a test whose
# need shows otherwise says so with `@pytest.mark.devices(n)`.
@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed and call.excinfo is not None:
        reason = _too_few_devices(call.excinfo.value)
        if reason is not None:
            report.outcome = "skipped"
            report.longrepr = (str(item.path), item.location[1], f"Skipped: {reason}")
    return report


# The same for a test module that builds its meshes when it is imported.
@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    report = yield
    n = jax.device_count()
    text = str(report.longrepr) if report.failed else ""
    if n < SUITE_DEVICES and "ValueError: Number of devices" in text:
        reason = (
            f"needs {SUITE_DEVICES} devices; {n} {jax.default_backend()} device(s) "
            "present (a mesh built when the module is imported)"
        )
        report.outcome = "skipped"
        report.longrepr = (str(collector.path), 0, f"Skipped: {reason}")
    return report
