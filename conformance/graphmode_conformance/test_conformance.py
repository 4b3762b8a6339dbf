"""The suite as `graphmode conformance` runs it: vendor and device come from
the plugin's command-line options."""

from graphmode_conformance import ConformanceTests


class TestConformance(ConformanceTests):
    pass
