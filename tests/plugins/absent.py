"""A vendor whose runtime is missing: it cannot run on its own device."""

from graphmode import VendorInfo, hookimpl


@hookimpl
def graphmode_vendor_info():
    return VendorInfo("absent", ("npu",), "torch_npu", None, False, "torch_npu is not installed")


@hookimpl
def graphmode_compatible_size(batch_size, capture_sizes):
    return capture_sizes[-1]
