"""graphmode's conformance suite: proof that a vendor's graphs equal eager.

Run it with ``graphmode conformance``, or plug it into your own test tree::

    # conftest.py
    pytest_plugins = ["graphmode_conformance.plugin"]

    # test_my_vendor.py
    import graphmode, pytest, torch
    from graphmode_conformance import ConformanceTests

    class TestMyVendor(ConformanceTests):
        @pytest.fixture
        def vendor(self):
            return graphmode.load_vendor("myvendor")

        @pytest.fixture
        def device(self):
            return torch.device("npu")

See docs/conformance.md.
"""

from graphmode_conformance.back_to_back import BackToBackTests
from graphmode_conformance.capture_policy import CapturePolicyTests
from graphmode_conformance.detection import DetectionTests
from graphmode_conformance.dist_backend import DistributedBackendTests
from graphmode_conformance.draft import DraftModelTests
from graphmode_conformance.equivalence import GraphEqualsEagerTests
from graphmode_conformance.fixtures import ConformanceFixtures
from graphmode_conformance.harness import ConformanceFailure, Harness, Sizes
from graphmode_conformance.hooks import HookContractTests
from graphmode_conformance.host_waits import HostWaitTests
from graphmode_conformance.kernels import KernelTests
from graphmode_conformance.lifecycle import (
    CapabilityTests,
    KVCacheIntegrityTests,
    LifecycleTests,
    ParameterUpdateTests,
)
from graphmode_conformance.multi_token import MultiTokenDecodeTests
from graphmode_conformance.option_effects import OptionVariantEffectTests
from graphmode_conformance.outputs import MultiOutputTests
from graphmode_conformance.piecewise import PiecewiseTests
from graphmode_conformance.planning import PlanningStateTests
from graphmode_conformance.pool import MemoryPoolTests
from graphmode_conformance.served_memory import ServedMemoryTests
from graphmode_conformance.step_inputs import StepInputsTests
from graphmode_conformance.token_limits import TokenLimitTests
from graphmode_conformance.unseen import UnseenByOutputsTests
from graphmode_conformance.variants import GraphVariantTests

__all__ = [
    "BackToBackTests",
    "CapabilityTests",
    "CapturePolicyTests",
    "ConformanceFailure",
    "ConformanceFixtures",
    "ConformanceTests",
    "DetectionTests",
    "DistributedBackendTests",
    "DraftModelTests",
    "GraphEqualsEagerTests",
    "GraphVariantTests",
    "Harness",
    "HookContractTests",
    "HostWaitTests",
    "KVCacheIntegrityTests",
    "KernelTests",
    "LifecycleTests",
    "MemoryPoolTests",
    "MultiOutputTests",
    "MultiTokenDecodeTests",
    "OptionVariantEffectTests",
    "ParameterUpdateTests",
    "PiecewiseTests",
    "PlanningStateTests",
    "ServedMemoryTests",
    "Sizes",
    "StepInputsTests",
    "TokenLimitTests",
    "UnseenByOutputsTests",
]


# pytest collects inherited tests from the last base to the first: the quick,
# precise hook-contract checks run first, the long equivalence runs last, and
# the draft model's checks (two runners, whose failures a one-runner check
# names more precisely) after all, and the checks of issue 40's vendor bugs
# last (each plain to diagnose alone; a vendor failing an earlier check has
# that failure first, as before they were added).
class ConformanceTests(
    TokenLimitTests,
    HostWaitTests,
    CapturePolicyTests,
    DistributedBackendTests,
    OptionVariantEffectTests,
    DraftModelTests,
    GraphVariantTests,
    PlanningStateTests,
    MultiOutputTests,
    BackToBackTests,
    ServedMemoryTests,
    MemoryPoolTests,
    MultiTokenDecodeTests,
    PiecewiseTests,
    GraphEqualsEagerTests,
    StepInputsTests,
    ParameterUpdateTests,
    KVCacheIntegrityTests,
    LifecycleTests,
    CapabilityTests,
    UnseenByOutputsTests,
    KernelTests,
    HookContractTests,
    DetectionTests,
):
    """Every check of the suite: inherit it and provide ``vendor`` and
    ``device`` (or run with the plugin's command-line options)."""
