"""Vendor plugins: discovery through entry points, loading, selection."""

from graphmode.plugins.manager import (
    BUILTIN_VENDOR,
    ENTRY_POINT_GROUP,
    ENV_PLUGINS,
    ENV_TRACE,
    Vendor,
    describe_vendors,
    installed_vendor_names,
    load_vendor,
    make_plugin_manager,
    vendor_statuses,
)
from graphmode.plugins.selection import ENV_VENDOR, select_vendor
from graphmode.vendor_info import CAPABILITIES, VendorInfo, probe_runtime

__all__ = [
    "BUILTIN_VENDOR",
    "CAPABILITIES",
    "ENTRY_POINT_GROUP",
    "ENV_PLUGINS",
    "ENV_TRACE",
    "ENV_VENDOR",
    "Vendor",
    "VendorInfo",
    "describe_vendors",
    "installed_vendor_names",
    "load_vendor",
    "make_plugin_manager",
    "probe_runtime",
    "select_vendor",
    "vendor_statuses",
]
