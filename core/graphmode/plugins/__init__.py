"""Vendor plugins: discovery through entry points, loading, selection."""

from graphmode.plugins.info import CAPABILITIES, VendorInfo, probe_runtime
from graphmode.plugins.manager import (
    BUILTIN_VENDOR,
    ENTRY_POINT_GROUP,
    ENV_PLUGINS,
    ENV_TRACE,
    Vendor,
    installed_vendor_names,
    load_vendor,
    make_plugin_manager,
)
from graphmode.plugins.selection import ENV_VENDOR, describe_vendors, select_vendor, vendor_statuses

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
