"""Hypothesis profiles for tests/test_properties.py.

- By default (no `--hypothesis-profile`), each property test runs the few examples it
    asks for, small enough for CI on 2 shared cores.
- `long`: many more examples, e.g. before a release:

        python -m pytest -p tests.hypothesis_profiles --hypothesis-profile=long \
            tests/test_properties.py

Hypothesis loads the profile named on the command line when pytest starts, before any
test module is imported, so this module must be loaded early: by `-p` as above, or by
an import in tests/conftest.py.
"""

from hypothesis import HealthCheck, settings


LONG = "long"

settings.register_profile(
    LONG,
    max_examples=1000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def examples(ci: int) -> settings:
    """Settings for one property test: `ci` examples, unless the `long` profile is
    loaded, whose number of examples then applies. No deadline: the first example of
    a shape compiles, which takes far longer than the rest."""
    health = [HealthCheck.too_slow, HealthCheck.data_too_large]
    if settings.get_current_profile_name() == LONG:
        return settings(deadline=None, suppress_health_check=health)
    return settings(max_examples=ci, deadline=None, suppress_health_check=health)
