"""graphmode plugin for Alibaba T-Head PPU accelerators (CUDA-compatible).

Registered through the ``graphmode`` entry-point group as ``ppu``; see
docs/vendors/ppu.md.
"""

__version__ = "0.1.0"
