"""The metadata a piecewise capture hands the model is a ghost
(:func:`shape_only`): its tensors are on the ``meta`` device, and the
engine's own host values in it (fields of its ``AttnMetadata`` subclass,
``vendor_fields`` entries that are no tensors) are :class:`GhostValue`
objects that refuse every use, so that code between the attention calls
that reads it fails at capture rather than freeze one step's values into
the graphs (the attention calls themselves get the live step's metadata).

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

import dataclasses
import os
from typing import Any, NoReturn

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graphmode.context import AttnMetadata
from graphmode.emulator.capture import call_site
from graphmode.errors import CaptureError
from graphmode.tensor_trees import tensors_in

__all__ = ["OPS_AT_OPS", "READ_INSIDE_OPS", "GhostReads", "GhostValue", "shape_only"]

_OWN_FIELDS = frozenset(f.name for f in dataclasses.fields(AttnMetadata))
READ_INSIDE_OPS = (
    "in piecewise modes the model sees attn_metadata with tensors on the 'meta' device, and only the AttentionOps "
    "calls get the step's real metadata, since code between them that reads attn_metadata would freeze one step's "
    "values into the graphs. Read it only inside the vendor's AttentionOps"
)
OPS_AT_OPS = (
    "Only the calls of the AttentionOps objects at `model.ops` and its submodules' `.ops` are intercepted, so a "
    "layer calling its ops from another attribute reaches them with this metadata too: keep them at `.ops`"
)


def shape_only(attn: AttnMetadata) -> AttnMetadata:
    """The metadata the model sees while a piecewise graph is captured: the
    same shapes and flags, but tensors on the ``meta`` device, maxima -1,
    and the engine's host values (its subclass's fields, ``vendor_fields``
    entries, other than tensors and None) :class:`GhostValue` objects.

    Only the break points may read the step's metadata (they get the live
    one at every replay); a segment reading it would freeze the capture
    step's values into the graph. With meta tensors it fails at capture
    instead ("Tensor on device meta is not on the expected device", or
    :class:`GhostReads`), with a ghost value at its first use."""

    def ghost(value: Any, name: str, engine_owned: bool) -> Any:
        if isinstance(value, torch.Tensor):
            return torch.empty(value.shape, dtype=value.dtype, device="meta")
        if isinstance(value, dict):
            return {key: ghost(item, f"{name}[{key!r}]", True) for key, item in value.items()}
        return GhostValue(name) if engine_owned and value is not None else value

    changes = {f.name: ghost(getattr(attn, f.name), f"attn_metadata.{f.name}", f.name not in _OWN_FIELDS)
               for f in dataclasses.fields(attn)}
    return attn.replace(**{**changes, "max_q_seq_len": -1, "max_kv_seq_len": -1})


class GhostValue:
    """A host value of the engine's step as a piecewise capture shows it:
    any use (truth, comparison, arithmetic, conversion, indexing, an
    attribute) raises :class:`CaptureError` naming it, since the graphs
    would keep the capture step's value for every later step."""

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "_name", name)

    def _refuse(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise CaptureError(
            f"the model used {object.__getattribute__(self, '_name')}, a host value of the engine's step, at "
            f"{call_site(os.path.abspath(__file__))}: {READ_INSIDE_OPS}, or pass the value as a declared step input "
            "(build_graph_runner(step_inputs=[BufferSpec(name, ...)]): a tensor the graphs read at every step), "
            f"or use execute_mode='graph'. {OPS_AT_OPS}"
        )

    def __repr__(self) -> str:
        return f"GhostValue({object.__getattribute__(self, '_name')})"

    __bool__ = __int__ = __index__ = __float__ = __len__ = __iter__ = __contains__ = __getitem__ = _refuse
    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _refuse
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _refuse
    __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = __neg__ = __format__ = __getattr__ = _refuse
    __hash__ = None  # type: ignore[assignment]


class GhostReads(TorchDispatchMode):
    """Refuse operators mixing ``meta`` tensors (the ghost metadata, or what
    the model computed from it) with tensors of a real device."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        tensors = tensors_in((args, kwargs))
        if any(t.is_meta for t in tensors) and not all(t.is_meta for t in tensors):
            raise CaptureError(
                f"{func} mixed a tensor on the 'meta' device with tensors of the model's device, at "
                f"{call_site(os.path.abspath(__file__))}: {READ_INSIDE_OPS} (rows picked from q_start_loc and "
                "q_seqlens, such as each sequence's last token, after the call), or use execute_mode='graph'. "
                f"{OPS_AT_OPS}"
            )
        return func(*args, **kwargs)
