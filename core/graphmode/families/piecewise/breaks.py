"""Break points: where a piecewise forward leaves its graphs and runs eagerly.

Two kinds, both found without changing the model:

- the vendor's attention operators, intercepted on the model's
  :class:`~graphmode.attention.AttentionOps` object while the runner warms up
  and captures (``fill_kv_cache``, ``prefill_attention``,
  ``paged_decode_attention``);
- :func:`host_break`, a marker an engine places around host work (offload
  loads, say); outside a piecewise capture it simply calls its function.

A break point is recorded at capture as a :class:`BreakCall` holding the very
tensors the model passed (outputs of the segment before it, at fixed
addresses) and, for calls with a result, the static buffer the segment after
it reads. At replay it runs with the step's own attention metadata, on the
live tokens only: padding tokens never reach the KV cache nor the attention.
"""

from __future__ import annotations

import abc
import contextlib
import inspect
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from graphmode.context import AttnMetadata
from graphmode.errors import CaptureError, ConfigError

__all__ = [
    "ATTENTION_METHODS",
    "Attention",
    "BreakCall",
    "HostWork",
    "KVWrite",
    "LiveStep",
    "find_attention_ops",
    "host_break",
    "kernels_taking_out",
    "intercepted",
    "shadowed",
    "writes_kv_in_graph",
]

#: The AttentionOps methods that are break points, and what each one is.
ATTENTION_METHODS = {
    "fill_kv_cache": "kv_write",
    "prefill_attention": "attention",
    "paged_decode_attention": "attention",
}

_local = threading.local()


@dataclass
class LiveStep:
    """What a break point needs from the step being run.

    attn: the step's own attention metadata (on the device), not a graph's
    context; tokens: its live token count; bucket: the graph's token count.
    """

    attn: AttnMetadata
    tokens: int
    bucket: int

    def __post_init__(self) -> None:
        if not 1 <= self.tokens <= self.bucket:
            raise ValueError(f"LiveStep: tokens={self.tokens} must be within 1..bucket={self.bucket}")


class BreakCall(abc.ABC):
    """One eager call between two segments, replayed at every step."""

    @abc.abstractmethod
    def run(self, live: LiveStep) -> None:
        """Run the call for this step (outside any graph)."""


class KVWrite(BreakCall):
    """``fill_kv_cache`` of the live tokens' keys and values: the padding
    tokens' rows are never passed, so they cannot write into the cache.

    ``in_graph``: the ops' write may instead be captured in the segment, over
    every row of the bucket, reading a static slot buffer whose padding rows
    hold -1 (see :func:`writes_kv_in_graph`)."""

    def __init__(self, write: Callable[..., Any], key: torch.Tensor, value: torch.Tensor, rest: tuple,
                 in_graph: bool = False) -> None:
        self.write, self.key, self.value, self.rest, self.in_graph = write, key, value, rest, in_graph

    def run(self, live: LiveStep) -> None:
        k_cache, v_cache, *extra = self.rest
        self.write(self.key[: live.tokens], self.value[: live.tokens], k_cache, v_cache, live.attn, *extra)

    def run_in_graph(self, attn: AttnMetadata) -> None:
        """The write of every row, with ``attn`` holding the static slots."""
        k_cache, v_cache, *extra = self.rest
        self.write(self.key, self.value, k_cache, v_cache, attn, *extra)


def writes_kv_in_graph(ops: Any) -> bool:
    """Whether a piecewise segment may capture ``ops.fill_kv_cache`` (rather
    than run it at the next break point): the class that defines the method
    declares ``kv_write_in_graph = True``, promising that the write reads
    nothing of the step's metadata but ``kv_start_indices`` and that a slot
    of -1 writes nothing (as every full graph's padding rows already rely
    on). A subclass that overrides ``fill_kv_cache`` declares it again, or its
    writes stay at the break points; so does an object whose own attribute
    replaces the method."""
    if "fill_kv_cache" in getattr(ops, "__dict__", {}):
        return False
    owner = next((c for c in type(ops).__mro__ if "fill_kv_cache" in vars(c)), None)
    return owner is not None and vars(owner).get("kv_write_in_graph") is True


class Attention(BreakCall):
    """Attention of the live tokens' queries, its result in the static buffer
    the next segment reads (padding rows zeroed).

    The kernel is chosen by the step, not by the call the model made at
    capture (a graph of a token bucket serves prefill, mixed and decode steps):
    ``paged_decode_attention`` when the step decodes one token per sequence,
    else ``prefill_attention`` (causal over the cached tokens, any lengths).
    A kernel with an ``out`` parameter writes into the buffer's rows; another
    kernel's result is copied there (at 32768 tokens and 24 layers, 1.4 GB
    of copies a step)."""

    def __init__(
        self, decode: Callable[..., Any], prefill: Callable[..., Any], query: torch.Tensor, rest: tuple,
        out: torch.Tensor,
    ) -> None:
        self.decode, self.prefill, self.query, self.rest, self.out = decode, prefill, query, rest, out
        self.writes_out = {kernel: takes_out(kernel) for kernel in (decode, prefill)}

    def run(self, live: LiveStep) -> None:
        tokens, attn = live.tokens, live.attn
        kernel = self.decode if attn.is_decoding and tokens == attn.batch_size else self.prefill
        k_cache, v_cache, scale, *extra = self.rest
        into = {"out": self.out[:tokens]} if self.writes_out[kernel] else {}
        result = kernel(self.query[:tokens], k_cache, v_cache, attn, scale, *extra, **into)
        if result is None and into:  # an out= kernel that returns nothing wrote the rows
            result = into["out"]
        store_rows(self.out, result, tokens)


class HostWork(BreakCall):
    """A :func:`host_break` call: the function with the arguments it was
    given at capture, its tensor result (if any) copied into a static buffer."""

    def __init__(self, fn: Callable[..., Any], args: tuple, kwargs: dict, out: torch.Tensor | None) -> None:
        self.fn, self.args, self.kwargs, self.out = fn, args, kwargs, out

    def run(self, live: LiveStep) -> None:
        result = self.fn(*self.args, **self.kwargs)
        if self.out is not None:
            self.out.copy_(checked_result(self.fn, result, self.out))


def takes_out(kernel: Callable[..., Any]) -> bool:
    """Whether an attention kernel takes ``out``, the tensor to write its
    result into (optional in the AttentionOps contract)."""
    try:
        return "out" in inspect.signature(kernel).parameters
    except (TypeError, ValueError):  # no signature to read (a C extension, say)
        return False


def kernels_taking_out(ops: Any) -> list[str]:
    """The names of ``ops``' attention kernels that take ``out``."""
    return [name for name, kind in ATTENTION_METHODS.items() if kind == "attention" and takes_out(getattr(ops, name))]


def store_rows(out: torch.Tensor, result: torch.Tensor, tokens: int) -> None:
    """``out[:tokens] = result`` (unless the kernel wrote it there), and the
    padding rows after it zeroed, so that no earlier step's values stay in
    the graph's rows."""
    rows = out[:tokens]
    if not (result.data_ptr() == rows.data_ptr() and result.shape == rows.shape and result.stride() == rows.stride()):
        rows.copy_(result)
    if tokens < out.shape[0]:
        out[tokens:].zero_()


def checked_result(fn: Callable[..., Any], result: Any, out: torch.Tensor) -> torch.Tensor:
    """The tensor a host_break function returned, checked against the static
    buffer captured for it."""
    if not isinstance(result, torch.Tensor) or result.shape != out.shape or result.dtype != out.dtype:
        got = f"{tuple(result.shape)} {result.dtype}" if isinstance(result, torch.Tensor) else type(result).__name__
        raise CaptureError(
            f"host_break({_name(fn)}) returned {got}, but at capture it returned {tuple(out.shape)} "
            f"{out.dtype}: the graph after it reads a buffer of that shape. Return the same shape and "
            "dtype at every step"
        )
    return result


# -- the session a forward runs in ---------------------------------------------


class Session(abc.ABC):
    """Where intercepted calls go during one forward under the runner: run
    now (the warm-up) or cut the capture (see ``graphs.py``)."""

    #: True while a break call runs: calls it makes in turn pass through.
    running = False

    @contextlib.contextmanager
    def calling(self) -> Iterator[None]:
        """While inside, the session's own call runs: ops it calls pass through."""
        self.running = True
        try:
            yield
        finally:
            self.running = False

    @abc.abstractmethod
    def kv_write(self, call: KVWrite) -> None: ...

    @abc.abstractmethod
    def attention(self, decode: Callable[..., Any], prefill: Callable[..., Any], query: torch.Tensor,
                  rest: tuple) -> torch.Tensor: ...

    @abc.abstractmethod
    def host_work(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any: ...


def active_session() -> Session | None:
    """The piecewise session of this thread, if a forward is under way."""
    return getattr(_local, "session", None)


@contextlib.contextmanager
def intercepted(ops_objects: list[Any], session: Session) -> Iterator[None]:
    """While inside: the attention methods of every object in ``ops_objects``
    are routed to ``session``, and :func:`host_break` too. The methods are
    shadowed by instance attributes and restored on exit, however it exits."""
    if active_session() is not None:
        raise CaptureError("a piecewise forward is already under way in this thread; they do not nest")
    with contextlib.ExitStack() as stack:
        for ops in ops_objects:
            originals = {name: getattr(ops, name) for name in ATTENTION_METHODS}
            in_graph = writes_kv_in_graph(ops)
            for name in ATTENTION_METHODS:
                stack.enter_context(shadowed(ops, name, _interceptor(name, originals, session, in_graph)))
        _local.session = session
        stack.callback(setattr, _local, "session", None)
        yield


@contextlib.contextmanager
def shadowed(obj: Any, name: str, value: Any) -> Iterator[None]:
    """``obj.name`` is ``value`` inside, its own attribute (or the class's)
    again after."""
    had_own = name in vars(obj)
    previous = vars(obj).get(name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if had_own:
            setattr(obj, name, previous)
        else:
            delattr(obj, name)


def _interceptor(name: str, originals: dict[str, Callable[..., Any]], session: Session,
                 in_graph: bool) -> Callable[..., Any]:
    original = originals[name]
    signature = inspect.signature(original)

    def call(*args: Any, **kwargs: Any) -> Any:
        if session.running:  # an op calling another op: part of the same break point
            return original(*args, **kwargs)
        values = list(_bound(signature, name, args, kwargs))
        if ATTENTION_METHODS[name] == "kv_write":
            key, value, k_cache, v_cache, _attn, *extra = values
            return session.kv_write(KVWrite(original, key, value, (k_cache, v_cache, *extra), in_graph))
        query, k_cache, v_cache, _attn, scale, *extra = values
        decode, prefill = originals["paged_decode_attention"], originals["prefill_attention"]
        return session.attention(decode, prefill, query, (k_cache, v_cache, scale, *extra))

    return call


def _bound(signature: inspect.Signature, name: str, args: tuple, kwargs: dict) -> Any:
    """The arguments in the AttentionOps order, whichever way they were passed."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as error:
        raise CaptureError(f"AttentionOps.{name} called with arguments its signature refuses: {error}") from None
    bound.apply_defaults()
    if bound.arguments.pop("out", None) is not None:
        raise CaptureError(
            f"AttentionOps.{name} called with out=: in piecewise graphs the break point chooses where "
            "attention writes (the buffer the next segment reads). Use the result the call returns"
        )
    return bound.arguments.values()


def find_attention_ops(model: Any) -> list[Any]:
    """The AttentionOps objects the model calls: ``model.ops`` and the ``ops``
    attribute of every submodule (the reference model and the Hugging Face
    adapter keep it there). Raises ConfigError when there is none."""
    candidates = [getattr(model, "ops", None)]
    if isinstance(model, torch.nn.Module):
        candidates += [getattr(module, "ops", None) for module in model.modules()]
    found: dict[int, Any] = {}
    for ops in candidates:
        if ops is not None and all(callable(getattr(ops, name, None)) for name in ATTENTION_METHODS):
            found.setdefault(id(ops), ops)
    if not found:
        raise ConfigError(
            f"piecewise graphs split the forward at the vendor's attention calls, but "
            f"{type(model).__name__} has no AttentionOps object at `model.ops` (or a submodule's `.ops`) "
            f"with {', '.join(ATTENTION_METHODS)}. Keep the ops the model calls there (as "
            "graphmode's reference model and Hugging Face adapter do), or use execute_mode='graph'"
        )
    return list(found.values())


# -- the explicit marker -------------------------------------------------------


def host_break(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` as host work between two piecewise segments.

    A model (or an engine's layer loop) calls it where host work must happen
    at every step: an offload engine's weight loads into a ring buffer, say.
    Under a piecewise runner, the segment before it ends there and the one
    after it starts there; at every replay ``fn`` runs between them with the
    arguments it was given at capture. ``fn`` returns None, or a tensor of the
    same shape and dtype at every step, which the next segment reads from a
    static buffer. Outside a runner it just calls ``fn``.

    Inside a full-graph capture it raises: the graph would hold whatever
    device work ``fn`` launched once, and never run its host part again.
    """
    session = active_session()
    if session is None or session.running:
        if session is None and _capturing():
            raise CaptureError(
                f"host_break({_name(fn)}) inside a full-graph capture: the host work would run once, at "
                "capture, and never at replay. Run this model with execute_mode='piecewise' (its graphs "
                "break at host_break), or 'eager'"
            )
        return fn(*args, **kwargs)
    return session.host_work(fn, args, kwargs)


def _capturing() -> bool:
    """Whether a device graph (or the emulator) is capturing in this thread:
    each device runtime is asked about its own streams (torch.cuda sees no
    NPU or MLU capture)."""
    from graphmode.emulator import current_session
    from graphmode.graphs.torch_graph import any_stream_capturing

    return current_session() is not None or any_stream_capturing()


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)
