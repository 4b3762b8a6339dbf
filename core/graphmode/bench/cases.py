"""The prefill benchmark's steps: prefill, chunked-prefill mixes and decode
steps over one paged KV cache holding random values.

A case is written ``NxL`` (N sequences prefilling L tokens each, no earlier
context), ``mixC+D`` (one C-token chunk after C cached tokens of its prompt,
plus D decodes) or ``decodeB`` (B decodes). Every case owns its own blocks,
and every step of a case has the same lengths, slots and block tables with
new token ids: a step reads only the random context and what it writes
itself, so its result does not depend on which case or mode ran before.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

import torch

from graphmode.context import AttnMetadata, StepInputs
from graphmode.kernels import cuda_attention_ops
from graphmode.model import LlamaModel, ModelConfig, build_reference_model

__all__ = ["Case", "PrefillWorkload", "parse_cases"]

_FORMS = "NxL (N sequences of L tokens), mixC+D (a C-token chunk plus D decodes) or decodeB (B decodes)"


@dataclass(frozen=True)
class Case:
    """One kind of step: per sequence, tokens already cached and tokens added.

    name: as written on the command line; is_decoding: every sequence adds
    one token (a uniform decode step, which full graphs serve)."""

    name: str
    context: tuple[int, ...]
    new: tuple[int, ...]
    is_decoding: bool = False

    def __post_init__(self) -> None:
        if not self.new or len(self.context) != len(self.new):
            raise ValueError(f"case {self.name!r}: context {self.context} and new {self.new} must pair up, one per sequence")
        if min(self.new) < 1 or min(self.context) < 0:
            raise ValueError(f"case {self.name!r}: every sequence adds >= 1 token after >= 0 cached ones")
        if self.is_decoding and set(self.new) != {1}:
            raise ValueError(f"case {self.name!r}: a decode case adds exactly one token per sequence")

    @property
    def sequences(self) -> int:
        return len(self.new)

    @property
    def tokens(self) -> int:
        return sum(self.new)

    @property
    def longest(self) -> int:
        """The most tokens any sequence holds after the step."""
        return max(c + n for c, n in zip(self.context, self.new))


def parse_cases(text: str, decode_context: int, seed: int = 0) -> list[Case]:
    """The cases of a comma-separated list; decodes get a cached length
    drawn from 1..``decode_context`` - 1. Raises ValueError naming a bad item."""
    rng = random.Random(seed)
    cases = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        prefill = re.fullmatch(r"(\d+)x(\d+)", item)
        mix = re.fullmatch(r"mix(\d+)\+(\d+)", item)
        decode = re.fullmatch(r"decode(\d+)", item)
        match = prefill or mix or decode
        if match is None:
            raise ValueError(f"case {item!r} is not one of {_FORMS}")
        numbers = [int(n) for n in match.groups()]
        if min(numbers) < 1:
            raise ValueError(f"case {item!r}: sequences and tokens must be >= 1")
        if prefill:
            count, length = numbers
            cases.append(Case(item, (0,) * count, (length,) * count))
        elif mix:
            chunk, decodes = numbers
            contexts = tuple(rng.randrange(1, decode_context) for _ in range(decodes))
            cases.append(Case(item, (chunk, *contexts), (chunk,) + (1,) * decodes))
        else:
            contexts = tuple(rng.randrange(1, decode_context) for _ in range(numbers[0]))
            cases.append(Case(item, contexts, (1,) * numbers[0], is_decoding=True))
    if not cases:
        raise ValueError(f"no cases in {text!r}: give a comma-separated list of {_FORMS}")
    names = [case.name for case in cases]
    if len(set(names)) != len(names):
        raise ValueError(f"cases {names} repeat one: each case is a row of the table")
    return cases


@dataclass
class PrefillWorkload:
    """The model, one KV cache for every case (random values; block 0
    reserved), and each case's block tables. ``max_batches`` and ``width``
    are what a runner over these steps needs (most sequences in a step, the
    block-table width)."""

    model: LlamaModel
    kv_cache: list
    device: torch.device
    block_size: int
    width: int
    max_batches: int
    cases: list[Case]
    tables: dict[str, list[list[int]]]

    @classmethod
    def build(cls, config: ModelConfig, device: torch.device, cases: list[Case], *, block_size: int,
              attention: str | None = None, seed: int = 0) -> PrefillWorkload:
        longest = max(case.longest for case in cases)
        if longest > config.max_position_embeddings:
            raise ValueError(
                f"a case holds {longest} tokens in one sequence, above the model's "
                f"max_position_embeddings={config.max_position_embeddings}: use shorter cases"
            )
        ops = cuda_attention_ops(attention) if attention is not None else None
        model = build_reference_model(config, "cuda" if ops is None else None, device, seed=seed, ops=ops)
        width = -(-longest // block_size)
        rng = random.Random(seed)
        needs = {case.name: [-(-(c + n) // block_size) for c, n in zip(case.context, case.new)] for case in cases}
        blocks = list(range(1, sum(sum(n) for n in needs.values()) + 1))
        rng.shuffle(blocks)
        tables: dict[str, list[list[int]]] = {}
        for case in cases:
            tables[case.name] = []
            for need in needs[case.name]:
                owned, blocks = blocks[:need], blocks[need:]
                tables[case.name].append(owned + [0] * (width - need))
        kv_cache = model.make_kv_cache(1 + sum(sum(n) for n in needs.values()), block_size)
        generator = torch.Generator(device=device).manual_seed(seed)
        for pair in kv_cache:
            for tensor in pair:
                tensor.normal_(generator=generator)
        return cls(model, kv_cache, device, block_size, width, max(c.sequences for c in cases), cases, tables)

    def steps(self, case: Case, count: int, seed: int = 1) -> list[StepInputs]:
        """``count`` steps of ``case``: the same lengths, slots and tables,
        new token ids each."""
        rng = random.Random(f"{seed}/{case.name}")
        tables, size = self.tables[case.name], self.block_size
        positions: list[int] = []
        slots: list[int] = []
        starts: list[int] = []
        for table, context, new in zip(tables, case.context, case.new):
            starts.append(len(positions))
            for position in range(context, context + new):
                positions.append(position)
                slots.append(table[position // size] * size + position % size)
        device, int32 = self.device, torch.int32
        kv = [c + n for c, n in zip(case.context, case.new)]
        attn = AttnMetadata(
            is_decoding=case.is_decoding,
            block_offsets=torch.tensor(tables, dtype=int32, device=device),
            q_start_loc=torch.tensor(starts, dtype=int32, device=device),
            q_seqlens=torch.tensor(case.new, dtype=int32, device=device),
            kv_seqlens=torch.tensor(kv, dtype=int32, device=device),
            kv_start_indices=torch.tensor(slots, dtype=torch.int64, device=device),
            max_q_seq_len=max(case.new),
            max_kv_seq_len=max(kv),
            kv_seqlens_cpu=torch.tensor(kv, dtype=int32),
        )
        pos = torch.tensor([positions], dtype=torch.int64, device=device)
        vocab = self.model.config.vocab_size
        generator = torch.Generator().manual_seed(rng.randrange(2**31))
        return [
            StepInputs(torch.randint(vocab, (1, case.tokens), generator=generator).to(device), pos, self.kv_cache, attn)
            for _ in range(count)
        ]

    def last_tokens(self, case: Case) -> torch.Tensor:
        """Each sequence's last new token's row in the step's output: the
        logits an engine samples from."""
        ends, total = [], 0
        for new in case.new:
            total += new
            ends.append(total - 1)
        return torch.tensor(ends, device=self.device)
