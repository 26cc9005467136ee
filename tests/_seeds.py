"""Seeds and lengths of the random differential tests (``tests/test_random_*.py``).

By default each test draws ``range(n)``, its own ``n``: what CI runs, the same every run. A
longer campaign shifts and widens every test's seeds, and lengthens its call sequences,
without editing a test::

    TRITON_SCALER_SEED_BASE=1000 TRITON_SCALER_SEED_FACTOR=10 TRITON_SCALER_LENGTH_FACTOR=3 \\
        python -m pytest -q tests/test_random_sequences.py

- ``TRITON_SCALER_SEED_BASE``: an int >= 0 added to every seed (default 0);
- ``TRITON_SCALER_SEED_FACTOR``: an int >= 1, the seed count's multiplier (default 1);
- ``TRITON_SCALER_LENGTH_FACTOR``: an int >= 1, the calls' / steps' multiplier per seed
  (default 1); the distributed tests' time bound grows with both factors.

A failing seed is rerun alone with the same variables and ``-k``, e.g. ``-k 1234``.
"""

from __future__ import annotations

import os

#: each variable's default, which is also its smallest value
_DEFAULTS = {"TRITON_SCALER_SEED_BASE": 0, "TRITON_SCALER_SEED_FACTOR": 1,
             "TRITON_SCALER_LENGTH_FACTOR": 1}


def _setting(name: str) -> int:
    """The variable's value, checked: a bad one fails the collection with its name."""
    default = _DEFAULTS[name]
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < default:
        raise ValueError(f"{name} must be an int >= {default} (its default); got {text!r}")
    return value


def seeds(n: int) -> range:
    """A test's seeds: ``range(n)``, shifted by the seed base and widened by the seed factor."""
    base = _setting("TRITON_SCALER_SEED_BASE")
    return range(base, base + n * _setting("TRITON_SCALER_SEED_FACTOR"))


def length(n: int) -> int:
    """A test's calls or steps per seed: ``n`` times the length factor."""
    return n * _setting("TRITON_SCALER_LENGTH_FACTOR")


def time_bound(seconds: int) -> int:
    """A distributed test's time bound for its seeds: ``seconds`` times both factors."""
    return seconds * _setting("TRITON_SCALER_SEED_FACTOR") * _setting("TRITON_SCALER_LENGTH_FACTOR")
