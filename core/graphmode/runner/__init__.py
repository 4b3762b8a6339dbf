"""The runner: GraphRunner (``runner.py``) and its graph families
(``family.py``, ``full.py``, ``modes.py``; piecewise graphs live in
``graphmode.families.piecewise``).

Its names are imported on first use (PEP 562, as the top-level package's), so
that importing a module of this package (the piecewise family imports
``graphmode.families.family`` and ``cache_checks``) does not import the runner,
which imports the families: no import cycle.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["EAGER_REASONS", "CapturedGraph", "GraphRunner", "RunnerStats"]

_EXPORTS = {
    "CapturedGraph": "graphmode.families.full",
    "GraphRunner": "graphmode.runner.runner",
    "EAGER_REASONS": "graphmode.families.stats",
    "RunnerStats": "graphmode.families.stats",
}

if TYPE_CHECKING:
    from graphmode.families.full import CapturedGraph
    from graphmode.runner.runner import GraphRunner
    from graphmode.families.stats import EAGER_REASONS, RunnerStats
else:

    def __getattr__(name: str) -> Any:
        """A public name, imported on first use and kept."""
        if name not in _EXPORTS:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
