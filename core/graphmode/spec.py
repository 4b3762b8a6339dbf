"""What a vendor declares, as data: its graph buffers and its constraints.

A vendor plugin answers ``graphmode_graph_spec`` with a :class:`GraphSpec`.
The core allocates every declared buffer, snapshots its padding, fills the
live rows of each step and resets the rest in one fused copy, and builds the
captured step context from views of the buffers (:mod:`graphmode.buffers`).
A vendor overrides a buffer hook only for what data cannot say.

Example: MACA is the CUDA default with a slot column (one row per token)
and padding kv length 0::

    from graphmode.spec import CUDA_SPEC, TOKENS, BufferSpec

    MACA_SPEC = CUDA_SPEC.with_buffers(
        BufferSpec("kv_start_indices", torch.int64, shape=(TOKENS, 1), padding=-1),
        BufferSpec("kv_seqlens", torch.int32, padding=0),
    )

An engine declares its own per-step inputs (LoRA ids, M-RoPE positions,
embeddings) the same way, by ``build_graph_runner(step_inputs=[...])``: a
name that is not a field of the step context is a keyword argument of the
model, read from the step's ``extras``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import InitVar, dataclass, field
from typing import Any

import torch

from graphmode.buckets import capture_list, declared_max_capture_size, graded_sizes, largest_graph
from graphmode.context import BLOCKS, CONTEXT_DTYPES, REQUIRED_TENSORS, SEQUENCES, STEP_TENSORS, TOKENS
from graphmode.errors import ConfigError

__all__ = [
    "BLOCKS",
    "CUDA_SPEC",
    "CUDA_VENDOR_SPEC",
    "ROW_INDEX",
    "ROW_NUMBER",
    "SEQUENCES",
    "TOKENS",
    "MODEL_INPUTS",
    "VENDOR_FIELDS",
    "BufferSpec",
    "GraphSpec",
    "NoOptions",
    "context_path",
]

# Symbolic dimensions of a buffer's shape: TOKENS, SEQUENCES, BLOCKS (declared with the step context).

# Padding values that depend on the row: 0, 1, 2, ... and 1, 2, 3, ...
ROW_INDEX = "row_index"
ROW_NUMBER = "row_number"

Padding = int | float | bool | str

# The step context's fields, by path. Anything else is a model keyword argument.
_STEP_FIELDS = ("input_ids", "position_ids")
_ATTN_FIELDS = tuple(name for name, _ in STEP_TENSORS)
# Every graph context needs these as buffers; the rest are optional.
REQUIRED_CONTEXT = (*_STEP_FIELDS, *(f"attn_metadata.{name}" for name in REQUIRED_TENSORS))


VENDOR_FIELDS = "attn_metadata.vendor_fields"
MODEL_INPUTS = "extras"


def context_path(name: str, root: str = VENDOR_FIELDS) -> str:
    """Where a field called ``name`` lives in a step: ``input_ids``,
    ``attn_metadata.kv_seqlens``, else under ``root``: a vendor's own kernel
    input (``attn_metadata.vendor_fields.NAME``) or an engine's model input
    (``extras.NAME``)."""
    if name in _STEP_FIELDS:
        return name
    if name in _ATTN_FIELDS:
        return f"attn_metadata.{name}"
    return f"{root}.{name}"


@dataclass(frozen=True)
class BufferSpec:
    """One fixed input buffer the vendor's graphs read.

    name: the buffer's name, and the step field it carries unless
        ``source``/``context`` say otherwise (see :func:`context_path`): a
        field of the step context by that name, else, declared by a vendor,
        ``attn_metadata.vendor_fields[name]`` (an input of its own kernels),
        or, declared by an engine (``step_inputs``), the model keyword
        argument ``name`` (``extras``).
    dtype: its element type; a step's values are converted on copy (an
        engine's floating-point values for an integer dtype are refused).
    shape: its dimensions: integers and the symbols TOKENS (one row per new
        token), SEQUENCES (one row per sequence) and BLOCKS (the block
        table's width). Exactly one of TOKENS and SEQUENCES, the row
        dimension. input_ids is ``(1, TOKENS)``, a slot column ``(TOKENS, 1)``.
    padding: the value of every row no live token uses, reset at every step;
        a number, or ROW_INDEX / ROW_NUMBER (the row's index, from 0 / 1).
        It must be neutral: no KV write (slot -1), the reserved block 0, and
        lengths the kernel reads harmlessly.
    source: where a step's live rows come from: a step path
        (``"attn_metadata.kv_seqlens_cpu"``), several tried in order (the
        first that is not None), a function of the step computing them on
        the device (``lambda step: step.attn_metadata.kv_start_indices // 32``;
        no host reads), or None for a buffer no step writes (it always
        holds ``padding``, e.g. decode's q_seqlens of 1). By default the
        buffer's own context field.
    live: instead of ``source``, a constant every live row takes
        (x_active_mask: True).
    context: the step-context paths the captured forward sees as views of
        this buffer (``bucket`` rows). By default the buffer's own field.
    host: the buffer lives in host memory, for kernels that take host values
        (the graph freezes them: the vendor pushes them in before each
        replay); otherwise it lives on the device.
    q_len_scaled: the padding is multiplied by the graph's query length
        (its new tokens per sequence, q_len): for the per-sequence constants
        of a decode step, whose values depend on q_len. q_start_loc is
        ``ROW_INDEX`` scaled (each row's first token: 0, q_len, 2 q_len,
        ...), q_seqlens ``1`` scaled (q_len), a cumulative q_seqlens
        ``ROW_NUMBER`` scaled. The core writes the pattern of the step's
        q_len into the bucket's rows (padding rows, and live rows too when
        the buffer has no source): a graph of one q_len reads its own.
        Per-sequence buffers of integer dtype only.
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int | str, ...] = (SEQUENCES,)
    padding: Padding = 0
    source: str | tuple[str, ...] | Callable[[Any], torch.Tensor] | None = "default"
    live: int | float | bool | None = None
    context: tuple[str, ...] | None = None
    host: bool = False
    q_len_scaled: bool = False

    def __post_init__(self) -> None:
        where = f"BufferSpec({self.name!r})"
        if not self.name.isidentifier():
            raise ConfigError(f"{where}: a buffer name must be an identifier")
        if not isinstance(self.dtype, torch.dtype):
            raise ConfigError(f"{where}: dtype={self.dtype!r} is not a torch.dtype")
        rows = [d for d in self.shape if d in (TOKENS, SEQUENCES)]
        if len(rows) != 1:
            raise ConfigError(
                f"{where}: shape={self.shape} needs exactly one of TOKENS ({TOKENS!r}) or SEQUENCES "
                f"({SEQUENCES!r}) from graphmode.spec: a buffer holds one row per new token or per sequence. A "
                "per-step value (a live-token count) is a (TOKENS,) mask declared live=True, summed on the "
                "device; an array of one row per sequence plus one (cumulative starts after a leading 0) is "
                "computed in the kernels from q_seqlens or kv_seqlens (docs/writing-a-plugin.md)"
            )
        bad = [d for d in self.shape if not (d in (TOKENS, SEQUENCES, BLOCKS) or (isinstance(d, int) and d >= 1))]
        if bad:
            raise ConfigError(f"{where}: shape={self.shape} has {bad}; use ints >= 1, {TOKENS!r}, {SEQUENCES!r}, {BLOCKS!r}")
        if isinstance(self.padding, str) and self.padding not in (ROW_INDEX, ROW_NUMBER):
            raise ConfigError(f"{where}: padding={self.padding!r}; use a number, {ROW_INDEX!r} or {ROW_NUMBER!r}")
        holds_block_ids = BLOCKS in self.shape and not self.dtype.is_floating_point and self.dtype != torch.bool
        if holds_block_ids and (isinstance(self.padding, str) or self.padding > 0):
            # A padding row's table entry is a block it reads, and where a kernel writes through the
            # table, one it writes: block N > 0 may be a live sequence's.
            raise ConfigError(
                f"{where}: padding={self.padding!r} in a block table (shape {self.shape}, {self.dtype}): padding "
                "rows would read (and a kernel writing through the table would write) a block a live sequence "
                "may own. Pad a table with 0, the reserved block, or a negative sentinel your kernels skip"
            )
        if self.live is not None and self.source not in ("default", None):
            raise ConfigError(f"{where}: give a source or a live value, not both")
        if self.live is not None and self.source == "default":
            object.__setattr__(self, "source", None)
        elif isinstance(self.source, str) and self.source != "default":
            object.__setattr__(self, "source", (self.source,))
        if self.context is not None:
            object.__setattr__(self, "context", tuple(self.context))
        if self.q_len_scaled and (self.per_token or self.dtype.is_floating_point or self.dtype == torch.bool):
            raise ConfigError(
                f"{where}: q_len_scaled=True needs a per-sequence buffer (shape with {SEQUENCES!r}) of an "
                f"integer dtype; it has shape {self.shape} and dtype {self.dtype}"
            )

    def bound(self, root: str) -> BufferSpec:
        """This spec with its default context resolved under ``root``
        (vendor kernel inputs or model inputs)."""
        if self.context is not None:
            return self
        return dataclasses.replace(self, context=(context_path(self.name, root),))

    @property
    def contexts(self) -> tuple[str, ...]:
        """The context paths of this buffer (resolved by its GraphSpec)."""
        return self.context or (context_path(self.name),)

    @property
    def sources(self) -> tuple[str, ...]:
        """The step paths the live rows come from, in order; () for none or
        for a function source."""
        if self.source == "default":
            return self.contexts[:1]
        return self.source if isinstance(self.source, tuple) else ()

    @property
    def row_dim(self) -> int:
        return next(i for i, d in enumerate(self.shape) if d in (TOKENS, SEQUENCES))

    @property
    def per_token(self) -> bool:
        return self.shape[self.row_dim] == TOKENS

    @property
    def written(self) -> bool:
        """Whether steps write it (from a source or a live value)."""
        return self.source is not None or self.live is not None

    def size(self, max_batches: int, max_tokens: int, num_blocks: int) -> tuple[int, ...]:
        sizes = {TOKENS: max_tokens, SEQUENCES: max_batches, BLOCKS: num_blocks}
        return tuple(d if isinstance(d, int) else sizes[d] for d in self.shape)

    def allocate(self, max_batches: int, max_tokens: int, num_blocks: int, device: torch.device) -> torch.Tensor:
        """The buffer at full size, every row holding its padding value (on
        the host, marked as host memory on the emulator, when ``host``)."""
        from graphmode.emulator.host import mark_host

        shape = self.size(max_batches, max_tokens, num_blocks)
        on = torch.device("cpu") if self.host else device
        if isinstance(self.padding, str):
            rows = shape[self.row_dim]
            start = 0 if self.padding == ROW_INDEX else 1
            index = torch.arange(start, start + rows, dtype=self.dtype)
            view = [1] * len(shape)
            view[self.row_dim] = rows
            tensor = index.view(view).expand(shape).contiguous().to(on)
        else:
            tensor = torch.full(shape, self.padding, dtype=self.dtype, device=on)
        if self.host and device.type == "cpu":
            mark_host(tensor)
        return tensor


@dataclass(frozen=True)
class NoOptions:
    """The options of a vendor that takes none."""


#: The step's paths of one value per new token, which a per-sequence buffer holds only in one-token decode.
_PER_TOKEN_PATHS = frozenset(
    ["input_ids", "position_ids", *(f"attn_metadata.{name}" for name, shape in STEP_TENSORS if shape[0] == TOKENS)]
)


def _shown_shape(shape: tuple[int | str, ...]) -> str:
    names = [d.upper() if isinstance(d, str) else str(d) for d in shape]
    return "(" + ", ".join(names) + ("," if len(names) == 1 else "") + ")"


@dataclass(frozen=True)
class GraphSpec:
    """A vendor's graph buffers and constraints.

    buffers: every input buffer its graphs read (:class:`BufferSpec`).
    block_sizes: KV-cache block sizes its kernels accept; None for any. (The
        cache layout is the attention ops' ``layout`` and ``block_view``.)
    capture_policy: the capture list for a max_batches when the user gives
        none (``graded_sizes``, ``three_stage_sizes``, ...), ending at
        max_batches (or at ``max_capture_size``); or ``FixedSizes(...)``,
        the only sizes the hardware captures.
    max_capture_size: the largest batch one graph takes (the vendor's
        largest graph), None for no limit; a ``FixedSizes`` list's last size
        unless declared. Capture lists stop there: a user's list is trimmed
        to it, and batches above it run eagerly (the runner counts them as
        ``no_bucket`` eager steps).
    max_q_policy: what graph contexts pass as ``max_q_seq_len``: "bound" (the graph's query
        length, 1 in decode) or "dynamic" (-1: the kernel derives it).
    max_kv_policy: what they pass as ``max_kv_seq_len``: "dynamic" (-1) or "capacity" (the block table's
        capacity, num_blocks x block_size, for kernels that need a positive
        bound valid at every replay).
    options: the dataclass of its ``vendor_options``, with defaults; its
        ``__post_init__`` checks values. A field whose metadata has
        ``removed`` is an option of an earlier release, kept so that
        ``__post_init__`` can refuse it with the reason.
    max_q_len: the most new tokens per sequence its kernels take in a decode
        graph (speculative verify, MTP); None for no limit. 1 unless
        declared: a vendor opts in to multi-token decode graphs once its
        decode kernel takes several causal queries per sequence. A runner
        asking for more (``max_q_len``) is refused at configuration time,
        with ``max_q_len_reason`` (why the kernels stop there).
    option_variants: the ``vendor_options`` configurations the vendor must
        work under, each a dict of option fields (Ascend: both update
        paths). The conformance suite runs its harness under every one in
        every run; () runs it once, with the defaults.
    """

    buffers: tuple[BufferSpec, ...]
    block_sizes: tuple[int, ...] | None = None
    capture_policy: Callable[[int], list[int]] = graded_sizes
    max_capture_size: int | None = None
    max_q_policy: str = "bound"
    max_kv_policy: str = "dynamic"
    options: type = NoOptions
    max_q_len: int | None = 1
    max_q_len_reason: str = "its decode kernel is not declared to take several queries per sequence"
    option_variants: tuple[Mapping[str, Any], ...] = field(default=(), hash=False)
    names: tuple[str, ...] = field(init=False, repr=False)
    #: The name ``capture_policy`` had until 2026-12-04, refused with the new one (a TypeError named no fix).
    capture_sizes: InitVar[Any] = None

    def __post_init__(self, capture_sizes: Any) -> None:
        if capture_sizes is not None:
            raise ConfigError(
                f"GraphSpec capture_sizes={getattr(capture_sizes, '__name__', capture_sizes)!r}: the field is "
                "capture_policy now (capture_sizes names capture lists only); declare capture_policy=..."
            )
        object.__setattr__(self, "buffers", tuple(b.bound(VENDOR_FIELDS) for b in self.buffers))
        names = tuple(b.name for b in self.buffers)
        object.__setattr__(self, "names", names)
        duplicated = sorted({n for n in names if names.count(n) > 1})
        if duplicated:
            raise ConfigError(f"GraphSpec declares buffers {duplicated} more than once")
        contexts = [path for b in self.buffers for path in b.contexts]
        twice = sorted({p for p in contexts if contexts.count(p) > 1})
        if twice:
            raise ConfigError(f"GraphSpec: context fields {twice} are backed by more than one buffer")
        missing = [p for p in REQUIRED_CONTEXT if p not in contexts]
        if missing:
            raise ConfigError(f"GraphSpec: no buffer backs the context fields {missing}; every graph context needs them")
        if "block_offsets" in names and self.buffer("block_offsets").shape != (SEQUENCES, BLOCKS):
            raise ConfigError("GraphSpec: block_offsets must have shape (SEQUENCES, BLOCKS)")
        for spec in self.buffers:
            for path in spec.contexts:
                wanted = CONTEXT_DTYPES.get(path.removeprefix("attn_metadata."))
                if path.startswith("attn_metadata.") and wanted is not None and spec.dtype != wanted:
                    raise ConfigError(
                        f"GraphSpec: buffer {spec.name!r} backs {path} with dtype {spec.dtype}, but the step context "
                        f"defines it as {wanted} (graphmode.context.AttnMetadata): kernels reading it take that "
                        f"dtype. Declare BufferSpec({spec.name!r}, {wanted}, ...)"
                    )
        if self.max_q_policy not in ("bound", "dynamic"):
            raise ConfigError(f"GraphSpec max_q_policy={self.max_q_policy!r}: use 'bound' or 'dynamic'")
        if self.max_kv_policy not in ("dynamic", "capacity"):
            raise ConfigError(f"GraphSpec max_kv_policy={self.max_kv_policy!r}: use 'dynamic' or 'capacity'")
        if self.block_sizes is not None:
            object.__setattr__(self, "block_sizes", tuple(self.block_sizes))
        object.__setattr__(self, "max_capture_size", declared_max_capture_size(self.capture_policy, self.max_capture_size))
        if self.max_q_len is not None and (not isinstance(self.max_q_len, int) or self.max_q_len < 1):
            raise ConfigError(f"GraphSpec max_q_len={self.max_q_len!r}: use an int >= 1, or None for no limit")
        if self.max_q_len != 1:
            for spec in self.buffers:
                per_token = [path for path in spec.sources if path in _PER_TOKEN_PATHS]
                if per_token and not spec.per_token:
                    raise ConfigError(
                        f"GraphSpec: buffer {spec.name!r} has one row per sequence (shape {_shown_shape(spec.shape)}) "
                        f"but takes {per_token[0]}, one value per new token: with max_q_len={self.max_q_len} a decode "
                        "graph's step carries several tokens per sequence, which its rows cannot hold. Declare it "
                        f"per token, shape={_shown_shape(tuple(TOKENS if d == SEQUENCES else d for d in spec.shape))} "
                        "(the same rows in one-token decode), or max_q_len=1"
                    )
        if not dataclasses.is_dataclass(self.options):
            raise ConfigError(f"GraphSpec options={self.options!r} must be a dataclass type")
        object.__setattr__(self, "option_variants", tuple(self.option_variants))
        known = {f.name for f in dataclasses.fields(self.options) if f.init and not f.metadata.get("removed")}
        for index, variant in enumerate(self.option_variants):
            if not isinstance(variant, Mapping):
                raise ConfigError(f"GraphSpec option_variants[{index}]={variant!r}: give a dict of option fields")
            unknown = sorted(set(variant) - known)
            if unknown:
                raise ConfigError(
                    f"GraphSpec option_variants[{index}] has {unknown}, not fields of {self.options.__name__} "
                    f"({sorted(known) or 'none'})"
                )

    def largest_graph(self, max_batches: int) -> int:
        """See :func:`graphmode.buckets.largest_graph`."""
        return largest_graph(self.capture_policy, self.max_capture_size, max_batches)

    def capture_list(self, max_batches: int, given: Sequence[int] | None = None) -> list[int]:
        """The built-in ``graphmode_capture_sizes``'s answer (:func:`graphmode.buckets.capture_list`)."""
        return capture_list(self.capture_policy, self.max_capture_size, max_batches, given)

    def buffer(self, name: str) -> BufferSpec:
        for spec in self.buffers:
            if spec.name == name:
                return spec
        raise KeyError(f"no buffer {name!r} declared; declared: {list(self.names)}")

    def with_buffers(self, *buffers: BufferSpec, drop: Iterable[str] = ()) -> GraphSpec:
        """This spec with ``buffers`` replacing the ones of the same name (or
        added after them) and the buffers named in ``drop`` left out."""
        given = {b.name: b for b in buffers}
        dropped = set(drop)
        kept = [given.pop(b.name, b) for b in self.buffers if b.name not in dropped]
        return dataclasses.replace(self, buffers=(*kept, *given.values()))

    def replace(self, **changes: Any) -> GraphSpec:
        return dataclasses.replace(self, **changes)

    @property
    def padding_kv_length(self) -> Padding:
        """The kv length a padding row passes to the kernel."""
        return self.buffer("kv_seqlens").padding

    def make_options(self, given: Any, vendor: str) -> Any:
        """The vendor's options object from what the engine passed: None (the
        defaults), a dict of fields, or an instance of ``options``."""
        cls = self.options
        if given is None:
            return cls()
        if isinstance(given, cls):
            return given
        if not isinstance(given, dict):
            raise ConfigError(
                f"vendor_options={given!r}: pass a dict or a {cls.__name__} for vendor {vendor!r}"
            )
        fields = [f for f in dataclasses.fields(cls) if f.init]
        unknown = sorted(set(given) - {f.name for f in fields})
        if unknown:
            current = sorted(f.name for f in fields if not f.metadata.get("removed"))
            raise ConfigError(
                f"unknown vendor_options {unknown} for vendor {vendor!r}; its options ({cls.__name__}) are "
                f"{current or 'none'}"
            )
        return cls(**given)


# The CUDA default, lmdeploy's contract: int64 tokens and slots, int32 block
# tables and lengths; padding reads the reserved block once (length 1) and
# writes nothing (slot -1). A decode graph of q_len tokens per sequence reads
# q_start_loc 0, q_len, 2 q_len, ... and q_seqlens q_len (q_len_scaled).
CUDA_SPEC = GraphSpec(
    buffers=(
        BufferSpec("input_ids", torch.int64, shape=(1, TOKENS)),
        BufferSpec("position_ids", torch.int64, shape=(1, TOKENS)),
        BufferSpec("block_offsets", torch.int32, shape=(SEQUENCES, BLOCKS)),
        BufferSpec("q_start_loc", torch.int32, padding=ROW_INDEX, source=None, q_len_scaled=True),
        BufferSpec("q_seqlens", torch.int32, padding=1, source=None, q_len_scaled=True),
        BufferSpec("kv_seqlens", torch.int32, padding=1),
        BufferSpec("kv_start_indices", torch.int64, shape=(TOKENS,), padding=-1),
    ),
)

# The declarations of the built-in CUDA vendor: CUDA_SPEC, whose decode kernels
# (the reference, and Triton with the reference for several queries per
# sequence) also take multi-token decode graphs. CUDA_SPEC itself, the base
# vendors derive from, keeps max_q_len=1: a vendor opts in for its own kernels.
CUDA_VENDOR_SPEC = CUDA_SPEC.replace(max_q_len=None)
