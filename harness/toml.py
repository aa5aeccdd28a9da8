"""``tomllib`` on Python >= 3.11, the ``tomli`` backport on 3.10 (vendor images often ship 3.10).

Every TOML read in harness goes through ``harness.toml.loads``/``load`` and catches
``harness.toml.TOMLDecodeError``, so the fallback is decided in exactly one place.
"""

from __future__ import annotations

try:
    import tomllib as _impl
except ModuleNotFoundError:  # Python 3.10: pyproject.toml depends on tomli there
    import tomli as _impl  # type: ignore[no-redef]

loads = _impl.loads
load = _impl.load
TOMLDecodeError = _impl.TOMLDecodeError
IMPLEMENTATION = _impl.__name__
