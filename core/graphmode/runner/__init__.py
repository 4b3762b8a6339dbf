"""The runner: GraphRunner (``runner.py``), on top of its graph families
(``graphmode.families``) and checks (``graphmode.checks``), which import
nothing of it."""

from __future__ import annotations

from graphmode.families.full import CapturedGraph
from graphmode.families.stats import EAGER_REASONS, RunnerStats
from graphmode.runner.runner import GraphRunner

__all__ = ["EAGER_REASONS", "CapturedGraph", "GraphRunner", "RunnerStats"]
