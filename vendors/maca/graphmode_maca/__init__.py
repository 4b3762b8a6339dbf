"""graphmode plugin for MetaX MACA GPUs (CUDA-compatible PyTorch).

Registered through the ``graphmode`` entry-point group as ``maca``; see
docs/vendors/maca.md.
"""

__version__ = "0.1.0"
