"""Hypothesis profiles for the property tests.

``kvcm-ci`` (the default) keeps the whole property suite well under 90 s on two cores;
``kvcm-dev`` runs more examples and longer programs; ``kvcm-thorough`` is for a soak before a
release. Pick one with ``KVCM_PROPERTY_PROFILE=kvcm-thorough pytest tests/property``.

The state machines apply the chosen profile to themselves
(``settings.get_profile(os.environ.get("KVCM_PROPERTY_PROFILE", "kvcm-ci"))``) instead of this
file loading it globally, so tests elsewhere that rely on Hypothesis's defaults are unaffected.

No profile has a deadline: a step's time depends on the machine and on the pool a machine
built, not on a regression worth failing for. Examples are derandomized in CI so that a red run
replays exactly on a developer's machine.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings

_COMMON = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
}

settings.register_profile(
    "kvcm-ci",
    max_examples=200,
    stateful_step_count=50,
    derandomize=True,
    print_blob=True,
    **_COMMON,
)
settings.register_profile("kvcm-dev", max_examples=300, stateful_step_count=60, **_COMMON)
settings.register_profile("kvcm-thorough", max_examples=3000, stateful_step_count=100, **_COMMON)
