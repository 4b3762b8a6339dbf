"""Checks of a step's inputs against the runner's limits.

Only host-side facts are checked (shapes, dtypes, placement, host maxima):
reading device values would synchronise every step. Each error names the
value, the limit, and the fix.
"""

from __future__ import annotations

import functools
import operator
from typing import TYPE_CHECKING, Any

import torch

from graphmode.checks.cache_layout import CacheGeometry, cache_geometry, check_cache_layout  # re-exported
from graphmode.checks.host_lengths import check_kv_max_holds_host
from graphmode.checks.signature import check_model_signature
from graphmode.checks.step_sizes import batch_size, token_count
from graphmode.config import RunnerConfig
from graphmode.context import REQUIRED_TENSORS, STEP_PATHS, STEP_TENSORS, AttnMetadata, StepInputs
from graphmode.emulator.host import is_host
from graphmode.errors import ConfigError, InputError
from graphmode.spec import BLOCKS, SEQUENCES, TOKENS, BufferSpec

if TYPE_CHECKING:
    from graphmode.plugins import Vendor

__all__ = [
    "CacheGeometry", "cache_geometry", "check_cache_layout", "check_inputs", "check_model", "check_model_ops",
    "uniform_q_len",
]

# int32 or int64 (AttnMetadata's contract): kernels index with those, torch reads a uint8 index as a
# mask, and a real cache's slots and block ids overflow the narrower ones.
_INTEGER = {torch.int64, torch.int32}
# Every step's tensors, by their paths in StepInputs (how errors name them), with the shapes declared
# on AttnMetadata's fields (ids and positions: (1, TOKENS)).
_NARROW = dict.fromkeys((torch.int16, torch.int8, torch.uint8), (
    " (kernels index with int32 or int64 only: an int16 index fails inside them, a uint8 one is read as a "
    "mask, and neither holds a real cache's slots and block ids)"))
_TENSORS = STEP_PATHS
_tensors_of = operator.attrgetter(*_TENSORS)
_DIMS = ((1, TOKENS), (1, TOKENS), *(dict(STEP_TENSORS)[name] for name in REQUIRED_TENSORS))


@functools.lru_cache(maxsize=1024)
def _shapes(batch: int, tokens: int, width: int) -> tuple[tuple[int, ...], ...]:
    """The shapes of _TENSORS in a step of these sizes (cached: steps repeat their sizes)."""
    sizes: dict[int | str, int] = {TOKENS: tokens, SEQUENCES: batch, BLOCKS: width}
    return tuple(tuple(d if isinstance(d, int) else sizes[d] for d in dims) for dims in _DIMS)


def check_inputs(inputs: StepInputs, config: RunnerConfig) -> tuple[int, bool]:
    """The step's batch size and whether its per-step tensors are on the host,
    after checking its inputs.

    The per-step tensors (ids, positions, block table, lengths, slots) are
    either all on the runner's device or all host (CPU) tensors: an engine
    that builds its steps on the host passes them as they are (see host
    staging in docs/architecture.md). On the emulator (device "cpu"), host
    tensors are those marked as host memory (``graphmode.emulator.mark_host``).
    """
    attn = inputs.attn_metadata
    if not isinstance(attn, AttnMetadata):
        raise InputError(
            f"attn_metadata is a {type(attn).__name__}; pass a graphmode.AttnMetadata"
        )
    tensors = _tensors_of(inputs)
    for name, value in zip(_TENSORS, tensors):
        if not isinstance(value, torch.Tensor):
            raise InputError(
                f"{name} is {_described(value)}; it must be a torch.Tensor: build it with "
                "torch.tensor(values, dtype=torch.int32, device=...) (int64 for ids, positions and slots)"
            )
    batch = batch_size(attn)
    if batch == 0:
        raise InputError(
            "batch size 0: a step needs at least one sequence; do not call the "
            "runner when nothing is scheduled"
        )
    if batch > config.max_batches:
        raise InputError(
            f"batch size {batch} is above max_batches={config.max_batches}; build the "
            f"runner with max_batches >= {batch}, or schedule fewer sequences per step"
        )
    _check_maxima_types(attn)
    width = attn.block_offsets.shape[-1]
    if width == 0:
        raise InputError(
            f"attn_metadata.block_offsets has shape {tuple(attn.block_offsets.shape)}: no block column, so "
            "no sequence has a block to read or write its tokens in (a graph would read garbage). Give each "
            "sequence's blocks, at least ceil(max_kv_seq_len / block_size) = "
            f"{max(1, -(-attn.max_kv_seq_len // config.block_size))} columns"
        )
    if width > config.max_blocks_per_seq:
        raise InputError(
            f"attn_metadata.block_offsets is {width} blocks wide, above the runner's "
            f"max_blocks_per_seq={config.max_blocks_per_seq} (the block table's width, not the "
            f"KV cache's size); build the runner with max_blocks_per_seq >= {width}"
        )
    _check_capacity(attn, width, config)
    tokens = token_count(inputs)
    if tokens == 0:
        raise InputError(
            f"a step of {batch} sequences and 0 new tokens: a step needs at least one new token (rows of zero "
            "new tokens are padding rows, legal beside others, but a step of padding alone computes nothing). "
            "Do not call the runner for an empty step"
        )
    _check_lengths(attn, batch, tokens)
    device = config.device
    # is_cpu and get_device() (an int) are cheaper than building a device.
    emulated, index = device.type == "cpu", device.index
    first_side: tuple[str, bool] | None = None
    for name, tensor, shape in zip(_TENSORS, tensors, _shapes(batch, tokens, width)):
        if tensor.dtype not in _INTEGER:
            raise InputError(
                f"{name} has dtype {tensor.dtype}; it must be an integer tensor "
                "(int64 or int32): convert it with .long() or .int()" + _NARROW.get(tensor.dtype, "")
            )
        if emulated:
            if not tensor.is_cpu:
                raise InputError(
                    f"{name} is on {tensor.device}, but the runner's device is {device}; "
                    "move it with .to('cpu')"
                )
            on_host = is_host(tensor)
        else:
            on_host = tensor.is_cpu
            if not on_host and tensor.get_device() != index:
                raise InputError(
                    f"{name} is on {tensor.device}, but the runner's device is {device}; "
                    f"move it with .to({str(device)!r}), or pass it as a host (CPU) tensor"
                )
        if first_side is None:
            first_side = (name, on_host)
        elif on_host != first_side[1]:
            where = {True: "the host", False: str(device)}
            raise InputError(
                f"{name} is on {where[on_host]} but {first_side[0]} is on {where[first_side[1]]}: "
                f"pass every per-step tensor on the host, or every one on {device}"
            )
        if tensor.shape != shape:
            raise InputError(
                f"{name} has shape {tuple(tensor.shape)}; a step of {batch} sequences "
                f"and {tokens} tokens needs {shape}"
            )
    _check_host_tensor(attn, batch)
    on_host = bool(first_side and first_side[1])
    check_values(inputs, config, batch, tokens, width, on_host)
    return batch, on_host


def _check_maxima_types(attn: AttnMetadata) -> None:
    for name in ("max_q_seq_len", "max_kv_seq_len"):
        value = getattr(attn, name)
        # A bool is an index too (True is 1): a flag passed by mistake would pass as a length.
        # A tensor is an index too (kv_seqlens.max()): every comparison would read it on the host.
        if not hasattr(type(value), "__index__") or isinstance(value, (bool, torch.Tensor)):
            tensor = isinstance(value, torch.Tensor)
            raise InputError(
                f"attn_metadata.{name} is {'a Tensor' if tensor else _described(value)}; it must be an int: the "
                f"step's largest {'query' if name == 'max_q_seq_len' else 'KV'} length, or -1 when unknown"
                + ("; a tensor's value would be read on the host at every step (a synchronisation for a device "
                   "tensor): pass int() of the lengths the engine keeps on the host" if tensor else "")
            )


def check_scalars(attn: AttnMetadata, config: RunnerConfig, batch: int, tokens: int, width: int) -> None:
    """The checks of a step's host values (its maxima), in the order
    :func:`check_inputs` makes them, for a step whose tensors' shapes,
    dtypes and placement are known to pass (``graphmode.checks.step_checks``)."""
    _check_maxima_types(attn)
    _check_capacity(attn, width, config)
    _check_lengths(attn, batch, tokens)


def _check_lengths(attn: AttnMetadata, batch: int, tokens: int) -> None:
    if attn.is_decoding:
        _check_decode(attn, batch, tokens)
    else:
        _check_maxima(attn, batch, tokens)


def _check_capacity(attn: AttnMetadata, width: int, config: RunnerConfig) -> None:
    capacity = config.max_blocks_per_seq * config.block_size
    if attn.max_kv_seq_len > capacity:
        raise InputError(
            f"max_kv_seq_len={attn.max_kv_seq_len} is above the {capacity} tokens a "
            f"block table can address (max_blocks_per_seq={config.max_blocks_per_seq} x "
            f"block_size={config.block_size}); raise max_blocks_per_seq or shorten the sequence"
        )
    if attn.max_kv_seq_len > width * config.block_size:
        raise InputError(
            f"max_kv_seq_len={attn.max_kv_seq_len} is above the {width * config.block_size} tokens the step's "
            f"block table addresses ({width} blocks x block_size={config.block_size}): kernels would read "
            "past it. Give the longest sequence enough blocks (a wider table), or pass its real length"
        )


def _check_host_tensor(attn: AttnMetadata, batch: int) -> None:
    host = attn.kv_seqlens_cpu
    if isinstance(host, torch.Tensor) and host.dtype not in _INTEGER:
        raise InputError(
            f"attn_metadata.kv_seqlens_cpu has dtype {host.dtype}; it must be int64 or int32, the lengths "
            "kernels take as host values (Ascend): convert it with .int()" + _NARROW.get(host.dtype, "")
        )
    if host is not None and (not isinstance(host, torch.Tensor) or host.device.type != "cpu" or host.shape != (batch,)):
        if not isinstance(host, torch.Tensor):
            raise InputError(
                f"attn_metadata.kv_seqlens_cpu is {_described(host)}; it must be a ({batch},) host "
                "tensor (torch.tensor(lengths, dtype=torch.int32)) or None"
            )
        raise InputError(
            f"attn_metadata.kv_seqlens_cpu has shape {tuple(host.shape)} on "
            f"{host.device}; it must be a ({batch},) host tensor or None"
        )


def check_values(inputs: StepInputs, config: RunnerConfig, batch: int, tokens: int, width: int,
                 on_host: bool) -> None:
    """The checks after the tensors' (the host lengths against the table when
    the maximum is unknown, else against the maximum; declared step inputs),
    which read values or extras every step."""
    attn = inputs.attn_metadata
    host = attn.kv_seqlens_cpu
    if host is not None and attn.max_kv_seq_len < 0:  # the length unknown: the host lengths say it
        _check_host_lengths(host, width, config)
    elif attn.max_kv_seq_len >= 0 and (host is not None or on_host):
        check_kv_max_holds_host(attn, on_host)
    if config.step_inputs and inputs.extras:
        _check_step_inputs(inputs, config, batch, tokens, width)


def _check_host_lengths(host: torch.Tensor, width: int, config: RunnerConfig) -> None:
    """Refuse host kv lengths past the step's table (PPU's device assertion blamed the graph contexts)."""
    capacity = width * config.block_size
    longest = int(host.max())
    if longest > capacity:
        row = int(host.argmax())
        raise InputError(
            f"attn_metadata.kv_seqlens_cpu holds {longest} (sequence {row}), above the {capacity} tokens the "
            f"step's block table addresses ({width} blocks x block_size={config.block_size}): the engine's "
            "kv lengths are longer than its block tables. Give the sequence enough blocks (a wider table, "
            f"up to max_blocks_per_seq={config.max_blocks_per_seq}), or pass its real length (kv_seqlens and kv_seqlens_cpu)"
        )


def _check_step_inputs(inputs: StepInputs, config: RunnerConfig, batch: int, tokens: int, width: int) -> None:
    """The engine's declared step inputs (``step_inputs``) given at this
    step: tensors of their declared shape on the runner's device or the
    host. Checked here rather than in the fill: a (T, 1) value would fill a
    (T,) buffer at capture, and the bucket would then refuse every right step."""
    sizes = {TOKENS: tokens, SEQUENCES: batch, BLOCKS: width}
    device = config.device
    for spec in config.step_inputs:
        value = inputs.extras.get(spec.name)
        if value is None:  # the fill says so for a graph step; eager steps may leave it out
            continue
        shape = tuple(sizes[d] if isinstance(d, str) else d for d in spec.shape)
        if not isinstance(value, torch.Tensor):
            raise InputError(
                f"step input {spec.name!r} is {_described(value)}; pass a torch.Tensor of shape {shape} "
                f"(declared {_declared(spec.shape)}, dtype {spec.dtype})"
            )
        if value.device != device and value.device.type != "cpu":
            raise InputError(
                f"step input {spec.name!r} is on {value.device}, but the runner's device is {device}; move it "
                f"with .to({str(device)!r}), or pass it as a host (CPU) tensor"
            )
        if tuple(value.shape) != shape:
            raise InputError(
                f"step input {spec.name!r} has shape {tuple(value.shape)}; declared {_declared(spec.shape)}, "
                f"this step of {batch} sequences and {tokens} tokens needs {shape}"
            )
        if not torch.can_cast(value.dtype, spec.dtype):  # the fill's copy would truncate it (float into int)
            raise InputError(
                f"step input {spec.name!r} is {value.dtype}, declared {spec.dtype}: its buffer would not hold "
                f"its values (a float truncated to an integer, 1.7 -> 1). Pass {spec.name}.to({spec.dtype}), "
                "or declare its dtype"
            )
        inexact = (value.dtype.is_floating_point or value.dtype.is_complex or spec.dtype.is_floating_point
                   or spec.dtype.is_complex)
        if value.dtype != spec.dtype and inexact:
            # Graph steps would get the buffer's dtype, eager steps the engine's tensor: the model computes
            # in another precision in each (float32 into a bfloat16 buffer: logits 0.002 apart).
            raise InputError(
                f"step input {spec.name!r} is {value.dtype}, declared {spec.dtype}: graph steps would read it "
                f"rounded to {spec.dtype} (the buffer's), eager steps as given, so their results would differ. "
                f"Pass {spec.name}.to({spec.dtype}), or declare it {value.dtype}"
            )
        on_host = value.device != device or is_host(value)  # read without a synchronisation
        if value.dtype != spec.dtype and value.numel() and (on_host or config.debug):
            _check_narrowed(spec, value)


def _check_narrowed(spec: BufferSpec, value: torch.Tensor) -> None:
    """Refuse an integer step input given wider than declared (int64 for an
    int32 buffer) whose values the buffer cannot hold: its copy would wrap
    them (2**32 + 5 -> 5: another adapter's id, a live cache slot), where an
    eager step takes them as given. Read where it costs no synchronisation
    (a host tensor) and in debug mode."""
    if value.dtype == torch.bool or spec.dtype == torch.bool:
        return
    info, given = torch.iinfo(spec.dtype), torch.iinfo(value.dtype)
    # Compared in the value's dtype, only where its range passes the buffer's (int32 ids into an int64 buffer
    # widen losslessly, and int64's limits would wrap in int32).
    outside = torch.zeros(value.shape, dtype=torch.bool, device=value.device)
    if given.min < info.min:
        outside |= value < info.min
    if given.max > info.max:
        outside |= value > info.max
    if bool(outside.any()):
        bad = int(value[outside].reshape(-1)[0])
        wrapped = int(torch.tensor(bad, dtype=value.dtype).to(spec.dtype))
        raise InputError(
            f"step input {spec.name!r} holds {bad} ({value.dtype}), outside {spec.dtype}'s range "
            f"{info.min}..{info.max}: its {spec.dtype} buffer would hold {wrapped} in graph steps, where eager steps "
            f"take {bad}. Pass values the declared dtype holds, or declare it {value.dtype}"
        )


def _declared(shape: tuple[int | str, ...]) -> str:
    names = [d.upper() if isinstance(d, str) else str(d) for d in shape]
    return "(" + ", ".join(names) + ("," if len(names) == 1 else "") + ")"


def _described(value: object) -> str:
    """How an error names a value that should have been a tensor."""
    return "None" if value is None else f"a {type(value).__name__}"


def _check_decode(attn: AttnMetadata, batch: int, tokens: int) -> None:
    """Refuse an ``is_decoding`` step whose host facts cannot be a decode:
    every sequence adds at most ``max_q_seq_len`` tokens (a row adding none
    is a padding row, legal in every step: docs/engines.md, "Rows of zero
    new tokens"). Only host values are compared (the token count, the batch,
    the host maximum); the device ``q_seqlens`` are read in debug mode only
    (graphmode.checks.debug)."""
    q_max = attn.max_q_seq_len
    if q_max >= 0 and tokens > batch * q_max:
        raise InputError(
            f"is_decoding=True, but {tokens} new tokens for {batch} sequences with max_q_seq_len={q_max} "
            f"is not a decode step: a decode adds at most max_q_seq_len tokens per sequence (0 in a padding "
            f"row), so it needs tokens <= {batch} x max_q_seq_len (checked on the host: input_ids' length, "
            "the batch and max_q_seq_len; the device q_seqlens are read only in debug mode, GRAPHMODE_DEBUG=1). "
            "Pass is_decoding=False for a prefill or mixed step, or the step's real max_q_seq_len (or -1)"
        )


def _check_maxima(attn: AttnMetadata, batch: int, tokens: int) -> None:
    """Refuse host maxima that cannot hold (a varlen kernel sizes its work
    by them: one too small reads part of the step): ``tokens`` new tokens in
    ``batch`` sequences need a longest query of at least ``ceil(tokens /
    batch)``, and a sequence's KV length includes its new tokens. Fewer
    tokens than sequences is legal: the others are padding rows of no new
    token (docs/engines.md, "Rows of zero new tokens")."""
    q_max, kv_max = attn.max_q_seq_len, attn.max_kv_seq_len
    if q_max >= 0 and tokens > batch * q_max:
        raise InputError(
            f"max_q_seq_len={q_max}, but {tokens} new tokens in {batch} sequences need a longest query of at "
            f"least {-(-tokens // batch)}: pass the step's real max_q_seq_len (the largest q_seqlens), or -1"
        )
    if q_max >= 0 and 0 <= kv_max < q_max:
        raise InputError(
            f"max_kv_seq_len={kv_max} is below max_q_seq_len={q_max}: a sequence's KV length counts its "
            "cached tokens plus this step's new ones. Pass the step's real max_kv_seq_len (the largest "
            "kv_seqlens), or -1"
        )


def uniform_q_len(attn: AttnMetadata, batch: int, tokens: int) -> int | None:
    """The number of new tokens every sequence of a decode step carries, when
    host facts prove they all carry the same; None when they do not.

    No device value is read. ``max_q_seq_len`` bounds every ``q_seqlens``
    entry (the AttnMetadata contract, checked by :func:`_check_decode`
    against the token count), so ``tokens == batch x max_q_seq_len`` means
    every entry equals it: entries of 0 to ``q`` summing to ``batch x q``.
    Anything else may hold a padding row of no new token (``[2, 0]`` has as
    many tokens as sequences), so a step with ``max_q_seq_len`` -1 (unknown)
    cannot be proved uniform, one token per sequence included."""
    q_max = attn.max_q_seq_len
    if q_max >= 1 and tokens == batch * q_max:
        return q_max
    return None


def check_model(model: Any, vendor: Vendor) -> None:
    """The start-up checks of a model: its forward's keywords, its attention ops' vendor."""
    check_model_signature(model)
    check_model_ops(model, vendor)


def check_model_ops(model: Any, vendor: Vendor) -> None:
    """Refuse, at start-up, a model whose attention ops follow another
    vendor's contract than the runner's vendor: its graph contexts would give
    those kernels buffers, lengths and host values they do not expect (an
    Ascend model under the CUDA runner fails deep inside the capture; others
    run with wrong padding rules). Only models that expose their ops as
    ``model.ops`` with a ``contract`` (the reference model, the Hugging Face
    adapter) are checked."""
    ops = getattr(model, "ops", None)
    contract = getattr(ops, "contract", None)
    if contract is None:
        return
    expected = vendor.attention_ops()
    wanted = getattr(expected, "contract", None)
    if wanted is not None and wanted != contract:
        raise ConfigError(
            f"the model's attention ops are {type(ops).__name__} (the {contract!r} contract, cache layout "
            f"{getattr(ops, 'layout', '?')}), but the runner's vendor {vendor.name!r} drives "
            f"{type(expected).__name__} (the {wanted!r} contract): its graphs would feed the kernels "
            f"buffers and lengths they do not expect. Build the model with the runner's vendor "
            f"(build_reference_model(config, {vendor.name!r}) or the Hugging Face adapter's vendor={vendor.name!r}), "
            f"or the runner with vendor={contract!r}"
        )
