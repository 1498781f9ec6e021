"""The suite on another backend (tests/conftest.py): a test written for 8 devices
skips, saying why, where fewer are present; any other failure stays a failure."""

import jax
import pytest

from . import conftest


def _error(fn):
    try:
        fn()
    except Exception as e:
        return e
    raise AssertionError("no error")


@pytest.mark.devices(8)  # asserts what the suite's own 8 CPU devices give
def test_too_few_devices_is_a_skip_reason(monkeypatch):
    mesh_error = _error(lambda: jax.make_mesh((16,), ("x",)))
    index_error = _error(lambda: jax.devices()[8])
    # Every device the suite is written for is present: a failure, not a skip.
    assert jax.device_count() == conftest.SUITE_DEVICES
    assert conftest._too_few_devices(mesh_error) is None
    assert conftest._too_few_devices(index_error) is None

    monkeypatch.setattr(jax, "device_count", lambda: 1)
    assert conftest._too_few_devices(mesh_error) == (
        "needs 8 devices; 1 cpu device(s) present (ValueError: Number of devices 8 "
        "must be >= the product of mesh_shape (16,))"
    )
    assert conftest._too_few_devices(index_error) == (
        "needs 8 devices; 1 cpu device(s) present (IndexError: list index out of range)"
    )
    # Found as the cause of another error, or inside an exception group.
    try:
        raise RuntimeError("while building the mesh") from mesh_error
    except RuntimeError as e:
        assert conftest._too_few_devices(e) is not None
    group = ExceptionGroup("examples", [ValueError("other"), index_error])
    assert conftest._too_few_devices(group) is not None
    # Anything else stays a failure.
    assert conftest._too_few_devices(ValueError("Number of leaves 3")) is None
    assert conftest._too_few_devices(IndexError("tuple index out of range")) is None


@pytest.mark.devices(9)
def test_devices_marker_skips_where_fewer_are_present():
    raise AssertionError("collected with 8 devices: the marker did not skip it")
