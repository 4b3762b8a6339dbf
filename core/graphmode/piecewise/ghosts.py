"""The metadata a piecewise capture hands the model is a ghost: its tensors
are on the ``meta`` device (``graphs.shape_only``), so that code between
the attention calls that reads it fails at capture rather than freeze one
step's values into the graphs.

Most operators refuse a ``meta`` tensor beside real ones ("Tensor on device
meta is not on the expected device"), but indexing does not: ``x[index]``,
``index_select``, ``gather``, ``embedding`` and ``index_put_`` with a
``meta`` index into a CPU tensor return a CPU tensor of whatever memory held
(torch 2.13). A model picking each sequence's rows with
``q_start_loc + q_seqlens - 1`` got garbage at its piecewise warm-up and a
device error at replay. :class:`GhostReads` refuses every operator that
mixes ``meta`` tensors with real ones while a piecewise warm-up and capture
run, naming the operator and the model's line. Not under ``compile=True``
(Dynamo traces the forward there, and a dispatch mode would be traced with it).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from graphmode.emulator.capture import call_site
from graphmode.errors import CaptureError

__all__ = ["GhostReads"]


class GhostReads(TorchDispatchMode):
    """Refuse operators mixing ``meta`` tensors (the ghost metadata, or what
    the model computed from it) with tensors of a real device."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        tensors = [leaf for leaf in tree_flatten((args, kwargs))[0] if isinstance(leaf, torch.Tensor)]
        if any(t.is_meta for t in tensors) and not all(t.is_meta for t in tensors):
            raise CaptureError(
                f"{func} mixed a tensor on the 'meta' device with tensors of the model's device, at "
                f"{call_site(os.path.abspath(__file__))}: in piecewise modes the model sees attn_metadata with tensors on the 'meta' "
                "device, and only the AttentionOps calls get the step's real metadata, since code between them "
                "that reads attn_metadata would freeze one step's values into the graphs. Read it only inside "
                "the vendor's AttentionOps (rows picked from q_start_loc and q_seqlens, such as each "
                "sequence's last token, after the call), or use execute_mode='graph'"
                "; only the calls of the AttentionOps objects at `model.ops` and its submodules' `.ops` are intercepted, "
                "so a layer calling its ops from another attribute reaches them with this metadata too: keep them at `.ops`"
            )
        return func(*args, **kwargs)
