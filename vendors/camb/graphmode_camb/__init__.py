"""graphmode plugin for Cambricon MLUs (torch_mlu).

Registered through the ``graphmode`` entry-point group as ``camb``; see
docs/vendors/camb.md.
"""

__version__ = "0.1.0"
