"""Calls the named test functions of a test file directly (no pytest), against the
Equinox found on `PYTHONPATH`: whether the tests a patch adds fail before it.

    PYTHONPATH=/eqx/tree python upstream/new_tests.py TESTFILE NAME...
"""

import importlib.util
import sys
import traceback

import jax


jax.config.update("jax_num_cpu_devices", 2)
import equinox  # noqa: E402


spec = importlib.util.spec_from_file_location("tests_under_check", sys.argv[1])
assert spec is not None and spec.loader is not None
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
print("jax", jax.__version__, "equinox from", equinox.__file__)
for name in sys.argv[2:]:
    try:
        getattr(module, name)()
        print(name, "PASSED")
    except BaseException as e:
        first = str(e).splitlines()[0][:110] if str(e) else ""
        # A bare `assert`: the line that failed.
        first = first or traceback.extract_tb(e.__traceback__)[-1].line
        print(name, "FAILED", type(e).__name__, first)
