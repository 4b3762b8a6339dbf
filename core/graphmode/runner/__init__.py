"""The bucketed capture/replay runner."""

from graphmode.runner.runner import CapturedGraph, GraphRunner
from graphmode.runner.stats import EAGER_REASONS, RunnerStats

__all__ = ["EAGER_REASONS", "CapturedGraph", "GraphRunner", "RunnerStats"]
