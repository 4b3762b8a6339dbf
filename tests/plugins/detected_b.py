"""A vendor that says its hardware is present."""

from graphmode import VendorInfo, hookimpl

__version__ = "1.2.3"


@hookimpl
def graphmode_vendor_info():
    return VendorInfo("detected_b", ("cuda",), "fake runtime", "9.9", True, "fake device present")
