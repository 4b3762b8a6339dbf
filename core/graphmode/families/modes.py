"""Execute modes: each an ordered tuple of graph families. A step goes to
the first family that takes it (``GraphFamily.refusal`` is None), else it
runs eagerly, counted under the last family's reason ("eager_mode" where a
mode has none). Warm-up captures the families in reverse order.

| mode | families, in order |
|---|---|
| ``eager`` | none |
| ``graph`` | full decode graphs |
| ``piecewise`` | piecewise token graphs |
| ``full_and_piecewise`` | full decode graphs, then piecewise token graphs |
"""

from __future__ import annotations

from collections.abc import Callable

from graphmode.config import EXECUTE_MODES
from graphmode.errors import ConfigError
from graphmode.families.family import GraphFamily, RunnerContext
from graphmode.families.full import FullGraphs
from graphmode.families.piecewise.graphs import PiecewiseGraphs

__all__ = ["FAMILIES", "build_families"]

FAMILIES: dict[str, tuple[Callable[[RunnerContext], GraphFamily], ...]] = {
    "eager": (),
    "graph": (FullGraphs,),
    "piecewise": (PiecewiseGraphs,),
    "full_and_piecewise": (FullGraphs, PiecewiseGraphs),
}
assert set(FAMILIES) == set(EXECUTE_MODES), "every execute mode (graphmode.config.EXECUTE_MODES) has a row"


def build_families(shared: RunnerContext) -> tuple[GraphFamily, ...]:
    """The families of the runner's execute mode, in order."""
    config = shared.config
    families = tuple(family(shared) for family in FAMILIES[config.execute_mode])
    if config.host_staging and families and not any(family.stages_host for family in families):
        raise ConfigError(
            f"host_staging=True with execute_mode={config.execute_mode!r}: host staging (the pinned mirror) "
            "feeds the full decode graphs, which this mode has none of; piecewise graphs copy host steps to "
            "the device. Use execute_mode='graph' or 'full_and_piecewise', or host_staging=None"
        )
    return families
