"""graphmode plugin for Huawei Ascend NPUs (torch_npu).

Registered through the ``graphmode`` entry-point group as ``ascend``; see
docs/vendors/ascend.md.
"""

__version__ = "0.1.0"
