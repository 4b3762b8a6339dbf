"""The exceptions graphmode raises.

Every message says what was wrong (the value), the limit it broke, and how to
fix it. All derive from :class:`GraphModeError` so an engine can catch them in
one place; input and configuration errors are also ``ValueError``.
"""

from __future__ import annotations

__all__ = [
    "CaptureError",
    "ConfigError",
    "GraphModeError",
    "InputError",
    "ReplayError",
    "VendorError",
]


class GraphModeError(Exception):
    """Base class of every error graphmode raises on purpose."""


class ConfigError(GraphModeError, ValueError):
    """The runner configuration cannot work (bad size, refused setting)."""


class VendorError(GraphModeError, LookupError):
    """No usable vendor plugin, an unknown one, or more than one candidate."""


class InputError(GraphModeError, ValueError):
    """A step's inputs break the runner's contract (size, dtype, device)."""


class CaptureError(GraphModeError, RuntimeError):
    """Graph capture failed; the message says why and what to change."""


class ReplayError(GraphModeError, RuntimeError):
    """A replay would be wrong or would hang on the device."""
