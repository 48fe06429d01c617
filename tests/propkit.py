"""Hypothesis settings for the property-based tests, and the odd values they share.

Three profiles, chosen by ``$HYPOTHESIS_PROFILE``:
- ``ci`` (the default): every property test together stays well under a minute on a 2-core machine;
  no example database, so a run leaves no files behind and is the same on every machine.
- ``quick``: a fifth of the examples (at least 10 a test), as ``ci`` otherwise; the fast lane
  (``bash tests/run.sh --quick``) runs with it.
- ``thorough``: ten times the examples, with the example database in ``.hypothesis/`` so that a
  failure found once is tried first next time:
  ``HYPOTHESIS_PROFILE=thorough pytest tests/test_prop_*.py``.

A test states its ``max_examples`` for ``ci`` through ``examples(n)``; the other profiles scale it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
_SCALE = {"ci": 1.0, "quick": 0.2, "thorough": 10.0}
if PROFILE not in _SCALE:
    raise RuntimeError(f"HYPOTHESIS_PROFILE={PROFILE!r}: use one of {', '.join(_SCALE)}")

settings.register_profile(
    "ci",
    deadline=None,  # a shared 2-core machine has slow moments; time is bounded by the counts
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("quick", parent=settings.get_profile("ci"))
settings.register_profile(
    "thorough",
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(PROFILE)

F = TypeVar("F", bound=Callable[..., Any])


def examples(n: int) -> Callable[[F], F]:
    """``@settings(max_examples=n)`` under ``ci``, scaled under ``quick`` and ``thorough``."""
    return settings(max_examples=max(min(n, 10), round(n * _SCALE[PROFILE])))


# Characters users and machines slip into files: controls, NUL, escapes, separators, quotes,
# non-ASCII letters, zero-width and bidi marks, the YAML indicators.
ODD_CHARS = st.sampled_from(
    list("\x00\x01\x07\x08\t\n\r\x0b\x0c\x1b\x7f\x85\x9b\u2028\u200b\u202e\ufeffé✓")
    + list(" :#&*!|>'\"%@`{}[],-?=\\/.~")
)
# Text a file can hold: no lone surrogates (they cannot be encoded as UTF-8).
CHARACTERS = st.characters(codec="utf-8")
ODD_TEXT = st.one_of(
    st.text(alphabet=CHARACTERS, max_size=20),
    st.text(alphabet=st.one_of(ODD_CHARS, CHARACTERS), max_size=20),
    st.sampled_from(
        ["", " ", "~", "null", "true", "no", "0755", "4:00:00", "1e3", ".nan", "-.inf", "0x1f"]
    ),
)
# A huge string, built rather than drawn character by character; kept out of ODD_TEXT because
# pure-Python YAML reads ~1 MB/s, so tests draw it rarely.
HUGE_TEXT = st.integers(min_value=1_000, max_value=100_000).map(lambda n: "x" * n)
EXTREME_INTS = st.one_of(
    st.integers(min_value=-3, max_value=70_000),
    st.sampled_from([2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**40]),
    st.integers(),
)
EXTREME_FLOATS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1e-300, 5e-324, 1e308, float("inf"), float("nan")]),
)
SCALARS = st.one_of(st.none(), st.booleans(), EXTREME_INTS, EXTREME_FLOATS, ODD_TEXT)
# Any value YAML can give: scalars, and small lists and mappings of them.
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(ODD_TEXT, EXTREME_INTS), inner, max_size=4),
    ),
    max_leaves=12,
)
