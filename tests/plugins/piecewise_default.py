"""A vendor whose default execute mode is full graphs for decode, piecewise for the rest."""

from graphmode import VendorInfo, hookimpl


@hookimpl
def graphmode_vendor_info():
    return VendorInfo("piecewise_default", ("cuda",), "fake runtime", None, False, "test vendor",
                      execute_mode="full_and_piecewise")
