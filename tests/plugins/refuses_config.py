"""A plugin whose configuration check refuses every configuration, as a
vendor refusing the block size it is asked for does."""

from graphmode import ConfigError, VendorInfo, hookimpl


@hookimpl
def graphmode_vendor_info():
    return VendorInfo(name="refuses_config", device_types=("npu",), runtime="none", runtime_version=None,
                      detected=False, reason="no hardware here")


@hookimpl
def graphmode_check_config(config):
    raise ConfigError(f"block_size={config.block_size}: this vendor takes blocks of 128 tokens")
