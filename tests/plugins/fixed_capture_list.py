"""A vendor whose hardware captures only batch sizes 1, 2, 4, 8, 16 and 32,
written the way docs/writing-a-plugin.md says to declare it: the CUDA
default's buffers and kernels, with ``capture_policy=FixedSizes(...)``. Its
largest graph is 32; batches above it run eagerly. Its fill hook refuses
any other bucket, as the hardware would refuse to capture one, so a runner
asking for another size fails loudly rather than passing by luck.

A plugin object (``--plugin plugins.fixed_capture_list:plugin``): the
conformance suite runs on it in tests/test_conformance_suite.py. The region
below is shown in docs/writing-a-plugin.md (tests/test_writing_a_plugin.py
checks it word for word).
"""

from __future__ import annotations

from graphmode import VendorInfo, hookimpl
from graphmode.buckets import FixedSizes
from graphmode.spec import CUDA_SPEC, GraphSpec

# --8<-- [start:fixed_sizes]
FIXED_SPEC = CUDA_SPEC.replace(capture_policy=FixedSizes((1, 2, 4, 8, 16, 32)))  # its largest graph: 32
# --8<-- [end:fixed_sizes]
FIXED = (1, 2, 4, 8, 16, 32)


class FixedCaptureList:
    __version__ = "0.1.0"

    @hookimpl
    def graphmode_vendor_info(self) -> VendorInfo:
        return VendorInfo("fixed", ("cuda",), "a fixed-list runtime", None, False, "test vendor")

    @hookimpl
    def graphmode_graph_spec(self) -> GraphSpec:
        return FIXED_SPEC

    @hookimpl(wrapper=True)
    def graphmode_fill_buffers(self, meta, inputs, batch_size, bucket):
        if bucket not in FIXED:
            raise RuntimeError(f"the fixed-list hardware cannot run a graph of {bucket} sequences, only {FIXED}")
        return (yield)


plugin = FixedCaptureList()
