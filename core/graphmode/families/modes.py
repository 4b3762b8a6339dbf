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

from graphmode.config import EXECUTE_MODES
from graphmode.families.family import GraphFamily, Shared
from graphmode.families.full import FullGraphs
from graphmode.families.piecewise.graphs import PiecewiseGraphs

__all__ = ["FAMILIES", "build_families"]

FAMILIES: dict[str, tuple[type[FullGraphs] | type[PiecewiseGraphs], ...]] = {
    "eager": (),
    "graph": (FullGraphs,),
    "piecewise": (PiecewiseGraphs,),
    "full_and_piecewise": (FullGraphs, PiecewiseGraphs),
}
assert set(FAMILIES) == set(EXECUTE_MODES), "every execute mode (graphmode.config.EXECUTE_MODES) has a row"


def build_families(shared: Shared) -> tuple[GraphFamily, ...]:
    """The families of the runner's execute mode, in order."""
    return tuple(family(shared) for family in FAMILIES[shared.config.execute_mode])
