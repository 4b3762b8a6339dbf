"""Structural checks over every buffer the vendor declares
(:class:`graphmode.spec.GraphSpec`), not only the core's names.

- :class:`DeclaredBuffers` after every fill: the padding rows of the bucket
  hold the declared padding value, the block-table columns right of a
  narrower table too, rows no step writes hold their padding, and the live
  rows hold the step's values (its declared source, or the live constant).
  A failure names the buffer, the rows, their values, the hook responsible
  and the mechanism (left stale after a larger bucket ran, after a shrink
  inside the bucket, reset to a bound other than the bucket, a value other
  than the declared one).
- :func:`check_context`: every declared context field of a graph context is
  a view of its buffer's first rows, ``bucket`` of them.
- :func:`step_tensors` / :func:`check_unmodified`: the engine's own step
  tensors are left as they were.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from graphmode.buckets import next_power_of_2
from graphmode.buffers import step_value
from graphmode.context import StepInputs
from graphmode.meta import GraphMeta
from graphmode.spec import BLOCKS, BufferSpec, GraphSpec

__all__ = ["ConformanceFailure", "DeclaredBuffers", "check_context", "check_unmodified", "query_bound_problem",
           "step_tensors"]

_ATTN_TENSORS = ("block_offsets", "q_start_loc", "q_seqlens", "kv_seqlens", "kv_start_indices", "kv_seqlens_cpu", "x_active_mask")


class ConformanceFailure(AssertionError):
    """A check failed; the message names the check, the step and a likely cause."""


def _values(tensor: torch.Tensor, limit: int = 8) -> str:
    """Rows of a tensor for a message: scalars per row, or short lists."""
    rows = tensor.reshape(tensor.shape[0], -1) if tensor.dim() else tensor.reshape(1, 1)
    shown = [r[0].item() if r.numel() == 1 else r.tolist()[:6] for r in rows[:limit]]
    return f"{shown}{' ...' if rows.shape[0] > limit else ''}"


def _span(rows: list[int]) -> str:
    return f"{rows[0]}..{rows[-1]}" if rows == list(range(rows[0], rows[-1] + 1)) else str(rows[:12])


def _bad_rows(got: torch.Tensor, want: torch.Tensor) -> list[int]:
    """Indices (along dimension 0) of rows where got and want differ."""
    if got.numel() == 0:
        return []
    differ = (got != want).reshape(got.shape[0], -1).any(dim=1)
    return differ.nonzero().flatten().tolist()


def _rows_first(tensor: torch.Tensor, spec: BufferSpec) -> torch.Tensor:
    """The tensor with its row dimension first (input_ids is (1, tokens))."""
    return tensor.movedim(spec.row_dim, 0)


def source_value(spec: BufferSpec, step: StepInputs) -> Any:
    """The step's value for a sourced buffer's live rows, as the core reads it."""
    if callable(spec.source):
        return spec.source(step)
    for path in spec.sources:
        value = step_value(step, path)
        if value is not None:
            return value
    return None


class DeclaredBuffers:
    """Checks every declared buffer after a fill of ``(batch, bucket)`` and
    remembers the steps, to name how padding went stale."""

    def __init__(self, vendor: Any, meta: GraphMeta) -> None:
        self.vendor = vendor
        self.spec: GraphSpec = meta.spec
        cpu = torch.device("cpu")
        self.declared = {
            b.name: b.allocate(meta.max_batchs, meta.max_tokens, meta.num_blocks, cpu) for b in self.spec.buffers
        }
        self.last: tuple[int, int] | None = None  # (batch, bucket) of the last checked fill
        # The buffer objects at the last checked fill, and the dict holding them (one runner's).
        self.held: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] | None = None

    @staticmethod
    def snapshot(meta: GraphMeta) -> dict[str, torch.Tensor]:
        """The buffers' values now (before a fill), on the host."""
        return {name: t.detach().to("cpu", copy=True) for name, t in meta.input_buffers.items()}

    def check(
        self, where: str, meta: GraphMeta, step: StepInputs, batch: int, bucket: int, before: dict[str, torch.Tensor],
    ) -> None:
        """Raise :class:`ConformanceFailure` if a declared buffer does not
        hold what the declarations say after the fill of this step."""
        try:
            self._check_same_tensors(where, meta)
            problems = []
            for spec in self.spec.buffers:
                problem = self._check_buffer(spec, meta, step, batch, bucket, before)
                if problem:
                    problems.append((spec.name, problem))
            if problems:
                others = [name for name, _ in problems[1:]]
                more = f" (buffers {', '.join(others)} are wrong too)" if others else ""
                per_seq = step.num_tokens // batch
                rows = {
                    b.name: (step.num_tokens, bucket * per_seq) if b.per_token else (batch, bucket)
                    for b in self.spec.buffers if b.name in dict(problems)
                }
                danger = _live_slots_in_padding(meta, step, {b.name: b for b in self.spec.buffers if b.name in rows}, rows)
                raise ConformanceFailure(f"[declared buffers] {where}: {problems[0][1]}{more}{'.' if danger else ''}{danger}")
        finally:
            self.last = (batch, bucket)

    def _check_same_tensors(self, where: str, meta: GraphMeta) -> None:
        """A captured graph reads the tensors it was captured with: a buffer
        replaced in ``meta.input_buffers`` between two fills never reaches it."""
        buffers = meta.input_buffers
        held, self.held = self.held, (buffers, dict(buffers))
        if held is None or held[0] is not buffers:
            return
        replaced = [name for name in self.spec.names if name in held[1] and buffers.get(name) is not held[1][name]]
        if replaced:
            raise ConformanceFailure(
                f"[declared buffers] {where}: meta.input_buffers[{replaced[0]!r}] is another tensor than at the last "
                "fill: a hook replaced the buffer (meta.input_buffers[name] = a new tensor) rather than writing into "
                "it, so the graphs captured with the old one never see this step's values. Hook: "
                "graphmode_fill_buffers must write every buffer in place (buffer[:n].copy_(...)), at every step"
                + (f" (buffers {', '.join(replaced[1:])} were replaced too)" if replaced[1:] else "")
            )

    def _check_buffer(
        self, spec: BufferSpec, meta: GraphMeta, step: StepInputs, batch: int, bucket: int,
        before: dict[str, torch.Tensor],
    ) -> str | None:
        name = spec.name
        buffer = meta.input_buffers.get(name)
        if buffer is None:
            return f"buffer {name} is declared but graphmode_make_buffers did not make it"
        got = _rows_first(buffer.detach().cpu(), spec)
        per_seq = step.num_tokens // batch
        # A graph of q_len > 1 reads the q_len_scaled buffers' padding times q_len.
        scaled = meta.q_len_padding.get(per_seq, {}).get(name) if spec.q_len_scaled else None
        want = _rows_first(scaled.detach().cpu() if scaled is not None else self.declared[name], spec)
        if tuple(got.shape) != tuple(want.shape) or buffer.dtype != spec.dtype:
            return (
                f"buffer {name} is {tuple(buffer.shape)} {buffer.dtype}, declared {tuple(self.declared[name].shape)} "
                f"{spec.dtype}: graphmode_make_buffers made it otherwise than declared"
            )
        live, full = (step.num_tokens, bucket * per_seq) if spec.per_token else (batch, bucket)
        if not spec.written and self.vendor.implements("graphmode_fill_buffers"):
            # A buffer the vendor's own fill hook writes: its live rows are the
            # vendor's to check; its padding rows must hold the declared value.
            bad = [live + r for r in _bad_rows(got[live:full], want[live:full])]
            if bad:
                return self._padding_problem(spec, meta, got, want, before, bad, live, full, batch, bucket)
            return None
        if not spec.written:  # no step writes it: every row of the bucket holds its padding
            bad = _bad_rows(got[:full], want[:full])
            if bad:
                return (
                    f"buffer {name} (declared padding {spec.padding!r}, written by no step) rows {_span(bad)} hold "
                    f"{_values(got[bad])}: graphmode_fill_buffers wrote into a buffer the declarations say no step writes"
                )
            return None
        bad = [live + r for r in _bad_rows(got[live:full], want[live:full])]
        if bad:
            return self._padding_problem(spec, meta, got, want, before, bad, live, full, batch, bucket)
        live_rows = got[:live]
        if spec.live is not None:
            wrong = _bad_rows(live_rows, torch.full_like(live_rows, spec.live))
            if wrong:
                return (
                    f"buffer {name} live rows {_span(wrong)} hold {_values(live_rows[wrong])}, not the declared live "
                    f"value {spec.live!r}: graphmode_fill_buffers did not set them"
                )
            return None
        value = source_value(spec, step)
        if not isinstance(value, torch.Tensor):
            return None  # the runner refuses a step without it
        value = _rows_first(value.detach().cpu().to(spec.dtype), spec)
        held = _rows_first(before[name], spec)[:live] if name in before else None
        if BLOCKS in spec.shape:
            blocks = spec.shape.index(BLOCKS)
            dim = blocks + 1 if blocks < spec.row_dim else blocks  # with the row dimension moved first
            width = value.shape[dim]
            tail = live_rows.narrow(dim, width, live_rows.shape[dim] - width)
            tail_want = want[:live].narrow(dim, width, live_rows.shape[dim] - width)
            wrong = _bad_rows(tail, tail_want)
            if wrong:
                return (
                    f"buffer {name}: live rows {_span(wrong)} hold {_values(tail[wrong])} right of this step's "
                    f"{width}-column table, not the declared padding {spec.padding!r}: graphmode_fill_buffers left "
                    "columns of an earlier, wider table (block tables vary in width from step to step)"
                )
            live_rows = live_rows.narrow(dim, 0, width)
            held = held.narrow(dim, 0, width) if held is not None else None
        if value.numel() != live_rows.numel():
            return None  # the runner refuses a misshapen step input
        value = value.reshape(live_rows.shape)
        wrong = _bad_rows(live_rows, value)
        if wrong:
            origin = "its source function" if callable(spec.source) else " or ".join(spec.sources)
            skipped = ""
            if held is not None and torch.equal(live_rows, held):
                skipped = (": they are what the buffer held before this fill, so the copy was skipped for them. "
                           "A fill that skips it when the step's tensor seems unchanged (the same tensor or "
                           "data_ptr as the last step's, or values compared with a tensor kept from the last step "
                           "by reference) skips it when an engine writes its persistent tensors in place: compare "
                           "with a copy, or copy always")
            if name not in self.vendor.spec.names:
                skipped = (f". Buffer {name} is the engine's declared step input (build_graph_runner(step_inputs="
                           "...)), which meta.spec holds beside the vendor's own buffers: a fill of the vendor's own "
                           "declarations only (its module's GraphSpec rather than meta.spec, or a fixed list of "
                           "names) leaves it. Fill every buffer of meta.spec")
            how = skipped or _how_live_rows_differ(spec, buffer, live_rows, value, wrong, batch, step.num_tokens)
            return (
                f"buffer {name} live rows {_span(wrong)} hold {_values(live_rows[wrong])}, but this step's "
                f"{origin} is {_values(value[wrong])}: graphmode_fill_buffers did not copy the step's values "
                f"into the live rows{how}"
            )
        return None

    def _padding_problem(
        self, spec: BufferSpec, meta: GraphMeta, got: torch.Tensor, want: torch.Tensor,
        before: dict[str, torch.Tensor], bad: list[int], live: int, full: int, batch: int, bucket: int,
    ) -> str:
        name = spec.name
        head = (
            f"buffer {name} padding rows {_span(bad)} hold {_values(got[bad])}, not the declared padding "
            f"{spec.padding!r} (GraphSpec), after a batch of {batch} in bucket {bucket} (live rows 0..{live - 1}, "
            f"padding rows {live}..{full - 1})"
        )
        made = meta.padding_buffers.get(name)
        declared = _rows_first(self.declared[name], spec)  # want, unless scaled for a q_len > 1
        if made is not None and not torch.equal(_rows_first(made.detach().cpu(), spec)[bad], declared[bad]):
            return (
                f"{head}. Hook: graphmode_make_buffers made {name} holding {_values(_rows_first(made.cpu(), spec)[bad])} "
                "there, and every step resets padding rows to what it made: allocate each buffer holding its "
                "declared padding"
            )
        previous = _rows_first(before[name], spec) if name in before else None
        stale = previous is not None and not _bad_rows(got[bad], previous[bad])
        if not stale:
            note = ""
            repeated = _repeated_live_row(got, bad, live)
            if repeated is not None:
                note = (
                    f" They repeat live row {repeated}: the batch padded by repeating a live request; padding rows "
                    "must not share its slots, block table or lengths."
                )
            elif name == "kv_seqlens":
                note = (
                    f" That is a padding kv length other than the vendor's declared {spec.padding!r}, the length "
                    "its kernels need for padding rows."
                )
            return (
                f"{head}. Hook: graphmode_fill_buffers wrote {_values(got[bad])} into padding rows.{note} Fix: reset "
                "padding rows to the declared value (graphmode.buffers.fill does)"
            )
        first = bad[0]
        reset_before = previous is not None and first > live and bool(_bad_rows(previous[live:first], want[live:first]))
        if reset_before:
            bound = f"row {first}"
            if first == next_power_of_2(live):
                bound += f", the next power of two above the batch ({live})"
            mechanism = (
                f"it reset rows {live}..{first - 1} but not rows {first}..{full - 1}: padding reset to a bound "
                f"({bound}) other than the bucket ({full}); reset every row up to the bucket"
            )
        elif self.last is not None and self.last[1] > bucket:
            mechanism = (
                f"these rows still hold what the step of bucket {self.last[1]} (batch {self.last[0]}) wrote: "
                f"padding left stale when bucket {bucket} was reused after a larger bucket ran; reset every "
                "padding row at every step, whatever ran before"
            )
        elif self.last is not None and self.last[1] == bucket and self.last[0] > batch:
            mechanism = (
                f"these rows still hold the live values of the previous step (batch {self.last[0]}): padding "
                f"left stale after the batch shrank from {self.last[0]} to {batch} inside bucket {bucket}; reset "
                "every padding row at every step"
            )
        elif spec.per_token and full > bucket and first >= bucket:
            mechanism = (
                f"these rows still hold an earlier step's values, and all lie past row {bucket - 1}: in a graph of "
                f"q_len {full // bucket} the padding token rows run to bucket x q_len ({full}), and a reset that "
                f"stops at the bucket ({bucket} rows, its sequences) leaves them; reset every token row up to "
                "bucket x q_len"
            )
        else:
            mechanism = "these rows still hold an earlier step's values: padding left stale; reset every padding row at every step"
        return f"{head}. Hook: graphmode_fill_buffers did not reset them: {mechanism}"


def _repeated_live_row(got: torch.Tensor, bad: list[int], live: int) -> int | None:
    """The last live row, when every bad padding row copies it (a batch
    padded by repeating its last request), else None."""
    rows = got[bad]
    if live > 0 and not _bad_rows(rows, got[live - 1].expand_as(rows)):
        return live - 1
    return None


def _live_slots_in_padding(meta: GraphMeta, step: StepInputs, spec_of: dict[str, BufferSpec],
                           live: dict[str, tuple[int, int]]) -> str:
    """A sentence naming the padding rows of a slot buffer that hold slots
    this step's live tokens write, or slots of a live sequence's cached
    tokens (either way a padding token's write overwrites live KV), or the
    padding rows of a block-table buffer holding a live sequence's block
    (named only where no slot buffer writes live KV: a write is the worse
    harm); else ''."""
    reads_live = ""
    for name, spec in spec_of.items():
        fields = {name} | {path.rsplit(".", 1)[-1] for path in spec.sources}
        start, stop = live[name]
        rows = _rows_first(meta.input_buffers[name].detach().cpu(), spec)
        if "kv_start_indices" in fields:
            live_slots = {int(v) for v in rows[:start].flatten().tolist() if v >= 0}
            hit = [r for r in range(start, stop) if any(int(v) in live_slots for v in rows[r].flatten().tolist())]
            if hit:
                return (
                    f" Padding rows {_span(hit)} of {name} hold {_values(rows[hit])}: slots this step's live tokens "
                    "write, so the graph writes padding tokens' keys and values into a live sequence's KV block."
                )
            cached = _owned_slots(step, meta.block_size)
            hit = [r for r in range(start, stop) if any(int(v) in cached for v in rows[r].flatten().tolist())]
            if hit:
                slot = next(int(v) for v in rows[hit[0]].flatten().tolist() if int(v) in cached)
                seq, position = cached[slot]
                return (
                    f" Padding rows {_span(hit)} of {name} hold {_values(rows[hit])}: slot {slot} is sequence {seq}'s "
                    f"token at position {position} (block {slot // meta.block_size} of its table, cached before this "
                    "step), so every padding token writes its keys and values over a live sequence's KV. Padding "
                    "slots must be -1 (a fill-cache kernel skips them), never a slot of a block the engine gave "
                    "to a sequence."
                )
        if "block_offsets" in fields and BLOCKS in spec.shape and not reads_live:
            tables = step.attn_metadata.block_offsets.detach().cpu()
            owner = {int(b): r for r in reversed(range(tables.shape[0])) for b in tables[r].tolist() if b > 0}
            hit = [r for r in range(start, stop) if any(int(b) in owner for b in rows[r].flatten().tolist())]
            if hit:
                block = next(int(b) for b in rows[hit[0]].flatten().tolist() if int(b) in owner)
                reads_live = (
                    f" Padding rows {_span(hit)} of {name} point at block {block}, sequence {owner[block]}'s: "
                    "padding rows read a live sequence's KV (and a kernel writing by table, or a padding slot "
                    "derived from the table, writes there). Padding rows must read the reserved block 0, which "
                    "the engine gives to no sequence."
                )
    return reads_live


def _owned_slots(step: StepInputs, block_size: int) -> dict[int, tuple[int, int]]:
    """slot -> (sequence, position) for every token the step's sequences
    held before it (their kv lengths less this step's new tokens)."""
    attn = step.attn_metadata
    tables, kv, q = (t.detach().cpu().tolist() for t in (attn.block_offsets, attn.kv_seqlens, attn.q_seqlens))
    owned: dict[int, tuple[int, int]] = {}
    for seq, (table, length, new) in enumerate(zip(tables, kv, q)):
        for position in range(max(0, min(length - new, len(table) * block_size))):
            owned[table[position // block_size] * block_size + position % block_size] = (seq, position)
    return owned


def _how_live_rows_differ(spec: BufferSpec, buffer: torch.Tensor, live_rows: torch.Tensor, value: torch.Tensor,
                          wrong: list[int], batch: int, tokens: int) -> str:
    """A sentence naming how a buffer's live rows differ from the step's
    values, where one pattern explains every wrong row; else ''."""
    flat = value.flatten()
    memory = buffer.detach().cpu().contiguous().view(-1)
    for dtype in (torch.int16, torch.int32, torch.int64):
        if buffer.dtype.is_floating_point or buffer.dtype == torch.bool or dtype.itemsize == buffer.dtype.itemsize \
                or memory.numel() * memory.element_size() % dtype.itemsize:
            continue
        seen = memory.view(dtype)[:flat.numel()]
        if seen.numel() == flat.numel() and torch.equal(seen, flat.to(dtype)):
            return (
                f": its memory holds the step's values as {dtype} (written through a view of another dtype, "
                f"where the buffer is declared {spec.dtype}), which its kernels read as {spec.dtype} values. "
                f"Write the live rows as {spec.dtype} (buffer[:n].copy_(values) converts)"
            )
    if spec.per_token and tokens > batch and wrong[0] >= batch:
        return (
            f": its first {batch} rows (one per sequence) hold the step's values, rows past them do not. "
            f"A fill of {batch} rows, as for one token per sequence: a graph of {tokens // batch} tokens per "
            f"sequence reads {tokens} token rows; copy num_tokens rows"
        )
    if BLOCKS in spec.shape and live_rows.dim() == 2:
        columns = (live_rows != value).any(dim=0).nonzero().flatten().tolist()
        width = live_rows.shape[1]
        if columns and columns[0] > 0 and columns == list(range(columns[0], width)):
            named = f"column {columns[0]}" if len(columns) == 1 else f"columns {_span(columns)}"
            return (
                f": only {named} of this step's {width}-column table differ, its last: the first {columns[0]} "
                f"copied, where the step's table is {width} wide (an off-by-one in the width); a sequence reads "
                "the reserved block for the tokens of its last blocks. Copy every column of the step's table"
            )
    offset = (live_rows.long() - value.long())
    if offset.numel() and bool((offset == offset.flatten()[0]).all()) and int(offset.flatten()[0]) != 0:
        by = int(offset.flatten()[0])
        note = ""
        fields = {spec.name} | {path.rsplit(".", 1)[-1] for path in spec.sources}
        q_len = tokens // batch
        if fields & {"kv_seqlens", "kv_seqlens_cpu"} and by == -q_len:
            note = (
                f": the lengths of the cached tokens only, without this step's {q_len} new token(s) per sequence. "
                "A sequence's KV length counts them (attention reads them from the cache the step writes)"
            )
        return f": every live row is the step's value {by:+d}{note}"
    return ""


def _context_value(context: StepInputs, path: str) -> Any:
    try:
        return step_value(context, path)
    except AttributeError:
        return None


def check_context(
    where: str, spec: GraphSpec, meta: GraphMeta, context: StepInputs, batch: int, bucket: int, per_seq: int = 1,
) -> None:
    """Every declared context field of ``context`` (a graph context) is a
    view of its buffer's first rows, as many as the bucket has."""
    for buffer_spec in spec.buffers:
        buffer = meta.input_buffers[buffer_spec.name]
        rows = bucket * per_seq if buffer_spec.per_token else bucket
        for path in buffer_spec.contexts:
            value = _context_value(context, path)
            if not isinstance(value, torch.Tensor):
                raise ConformanceFailure(
                    f"[step context] {where}: {path} of the graph context is {type(value).__name__}, not a view of "
                    f"its declared buffer {buffer_spec.name}. Hook: graphmode_update_context must put every declared "
                    "context field in the context (graphmode.buffers.graph_context does)"
                )
            same = value.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
            if not same or value.data_ptr() != buffer.data_ptr():
                what = "another part of" if same else "not a view of"
                raise ConformanceFailure(
                    f"[step context] {where}: {path} of the graph context is {what} its buffer "
                    f"{buffer_spec.name}, so a graph would read the capture step's tensor forever. Hook: "
                    "graphmode_update_context does not point it at the first rows of its buffer"
                )
            got = value.shape[buffer_spec.row_dim] if value.dim() > buffer_spec.row_dim else None
            if got != rows:
                raise ConformanceFailure(
                    f"[step context] {where}: {path} has {got} rows for a batch of {batch} in bucket {bucket}; "
                    f"graphs must be captured at their bucket's size ({rows} rows). Hook: graphmode_update_context"
                )
            # Its other dimensions are the buffer's whole: a block table narrowed to the capture step's width
            # replays that width for every later step, whose longer sequences' blocks the graph never reads.
            others = [d for d in range(buffer.dim()) if d != buffer_spec.row_dim]
            if value.dim() != buffer.dim() or any(value.shape[d] != buffer.shape[d] for d in others):
                raise ConformanceFailure(
                    f"[step context] {where}: {path} has shape {tuple(value.shape)}, but its buffer "
                    f"{buffer_spec.name} has {tuple(buffer.shape)}: a graph context's field is the buffer's first "
                    f"{rows} rows whole (graphmode.buffers.graph_context), or the graph keeps the capture step's "
                    "narrower view (a block table cut to the capture step's width never reads a later step's "
                    "further blocks). Hook: graphmode_update_context"
                )


def query_bound_problem(context: StepInputs | None, q_len: int) -> str | None:
    """What is wrong with a captured graph context's ``max_q_seq_len`` below
    the ``q_len`` new tokens per sequence every replay of its graph carries
    (-1, "derive it", is not a bound); None when it holds or no context was
    recorded."""
    bound = context.attn_metadata.max_q_seq_len if context is not None else None
    if not isinstance(bound, int) or not 0 <= bound < q_len:
        return None
    return (
        f"the graph context has max_q_seq_len={bound}, but every replay of this graph carries {q_len} new tokens "
        f"per sequence: a graph freezes host values, and a kernel bounding each query by it reads {bound} of them "
        f"(or refuses the step). Graph contexts pass -1 where the kernel derives it on the device, or a bound valid "
        f"at every replay: the graph's q_len, {q_len}. Hook: graphmode_update_context (or the GraphSpec's "
        "max_q_seq_len policy)"
    )


def step_tensors(step: StepInputs) -> dict[str, torch.Tensor]:
    """Copies of every tensor the engine passed with a step, by path."""
    attn = step.attn_metadata
    found: dict[str, Any] = {"input_ids": step.input_ids, "position_ids": step.position_ids}
    found.update({f"attn_metadata.{n}": getattr(attn, n) for n in _ATTN_TENSORS})
    found.update({f"attn_metadata.vendor_fields.{n}": v for n, v in attn.vendor_fields.items()})
    found.update({f"extras.{n}": v for n, v in step.extras.items()})
    return {path: v.detach().clone() for path, v in found.items() if isinstance(v, torch.Tensor)}


def changed_tensors(step: StepInputs, snapshot: dict[str, torch.Tensor]) -> list[str]:
    now = step_tensors(step)
    return [p for p, v in snapshot.items() if p in now and not torch.equal(now[p], v)]


def check_unmodified(
    where: str, step: StepInputs, snapshot: dict[str, torch.Tensor], probes: list[tuple[str, Callable[[StepInputs], Any]]],
) -> None:
    """The engine's step tensors hold what they held before the runner ran;
    when one changed, ``probes`` (hook name, a call of that hook on a copy of
    the step) find the hook that changes them."""
    changed = changed_tensors(step, snapshot)
    if not changed:
        return
    path = changed[0]
    now = step_tensors(step)[path]
    culprit = "the graph step (no buffer hook changed it when called alone: the model's forward on the graph context?)"
    for hook, call in probes:
        probe = _copy_step(step, snapshot)
        call(probe)
        if changed_tensors(probe, snapshot):
            culprit = hook
            break
    raise ConformanceFailure(
        f"[engine inputs] {where}: the runner modified the engine's {path} in place: {_values(snapshot[path])} became "
        f"{_values(now)}{' (also ' + ', '.join(changed[1:]) + ')' if len(changed) > 1 else ''}. Hook: {culprit}. "
        "An engine reuses its step tensors (and runs eager steps on them): copy into the graph's buffers, never "
        "write into the step's tensors"
    )


def _copy_step(step: StepInputs, snapshot: dict[str, torch.Tensor]) -> StepInputs:
    """The step as it was before the runner ran, in fresh tensors."""
    def fresh(path: str, value: Any) -> Any:
        return snapshot[path].clone() if path in snapshot else value

    attn = step.attn_metadata.replace(
        **{n: fresh(f"attn_metadata.{n}", getattr(step.attn_metadata, n)) for n in _ATTN_TENSORS},
        vendor_fields={n: fresh(f"attn_metadata.vendor_fields.{n}", v) for n, v in step.attn_metadata.vendor_fields.items()},
    )
    extras = {n: fresh(f"extras.{n}", v) for n, v in step.extras.items()}
    return StepInputs(
        fresh("input_ids", step.input_ids), fresh("position_ids", step.position_ids), step.past_key_values, attn, extras
    )
