"""A draft model for speculative decoding, its decode steps in graphs.

:class:`DraftModel` drafts ``k`` tokens per request with a small causal LM of
the target's vocabulary, for ``serve_hf.serve`` to verify with the target. It
runs its steps through a runner of its own (its own model, KV cache and
graphs), built with ``share_pool_with=`` the target's runner so that both
sets of graphs share one memory pool, and it shares the target's block
tables: a request's block ids serve both caches.

Its cache holds, per request, every token it has seen: the prompt after
:meth:`DraftModel.prefill`; the request's tokens and its first ``k - 1``
drafts after :meth:`DraftModel.propose`. A verify step keeps the drafts the
target agreed with, so the next proposal feeds only what the draft cache
lacks: the target's own token, and the last draft as well when all ``k``
were accepted. One step of those 1 or 2 tokens per request, padded to the
longest (q_len 1 or 2), then ``k - 1`` steps of one token per request: all
graph replays of a runner built with ``max_q_len=2``. (A drafter that must
re-read the accepted tokens, as EAGLE and MTP heads do with the target's
hidden states, feeds ``accepted + 1`` tokens the same way: ``max_q_len=k + 1``.)

    python examples/serve_hf.py --random-config llama-tiny --draft-layers 1   # CPU emulator
"""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

import graphmode
from graphmode.integrations.huggingface import HuggingFaceModel

__all__ = ["DraftModel", "build_draft", "check_vocabulary", "first_layers"]


@dataclass
class _Seen:
    """What the draft cache holds of one request beyond its prompt."""

    confirmed: int  # the request's first tokens, known in the cache
    fed: list[int]  # drafts fed after them (positions confirmed, confirmed + 1, ...)


class DraftModel:
    """Proposes ``k`` greedy drafts per request (``serve_hf.serve``'s batch
    drafter). runner: the draft model's runner (``max_q_len=2`` to replay
    its first step too); kv_cache: the draft model's cache, of the target's
    block count and block size; batch: the target's ``PagedBatch``, whose
    blocks the draft cache uses at the same ids."""

    def __init__(self, runner: Any, kv_cache: Any, batch: Any) -> None:
        self.runner, self.kv_cache, self.batch = runner, kv_cache, batch
        self._seen: dict[int, _Seen] = {}
        #: First steps by q_len, and the padding tokens they carried.
        self.first_steps: Counter = Counter()
        self.padding = 0

    def prefill(self, requests: list) -> None:
        """The new requests' prompts into the draft cache (an eager step)."""
        step = self.batch.inputs(requests, [r.prompt for r in requests], [0] * len(requests), False)
        self.runner(past_key_values=self.kv_cache, **step)
        for request in requests:
            self._seen[id(request)] = _Seen(len(request.prompt), [])

    # --8<-- [start:propose]
    def propose(self, requests: list, k: int) -> list[list[int]]:
        """``k`` drafts per request: one step of the tokens the draft cache
        lacks (1 or 2 per request, padded to one q_len), then k - 1 steps of
        one token per request; every step a graph replay of the draft runner."""
        starts, pending = [], []
        for request in requests:
            seen, tokens = self._seen[id(request)], request.tokens
            kept = 0  # the fed drafts the target accepted: their keys stay valid
            while kept < len(seen.fed) and tokens[seen.confirmed + kept : seen.confirmed + kept + 1] == [seen.fed[kept]]:
                kept += 1
            starts.append(seen.confirmed + kept)
            pending.append(tokens[seen.confirmed + kept :])
        if not all(pending):
            raise RuntimeError("propose() twice without a verify step between: the draft cache has every token")
        q_len = max(map(len, pending))  # shorter ones padded: slot -1 writes nothing
        self.first_steps[q_len] += 1
        self.padding += sum(q_len - len(p) for p in pending)
        step = self.batch.inputs(requests, pending, starts, True, q_len=q_len)
        logits = self.runner(past_key_values=self.kv_cache, **step)
        last = torch.tensor([i * q_len + len(p) - 1 for i, p in enumerate(pending)], device=logits.device)
        drafts = [logits[0, last].argmax(-1).tolist()]
        positions = [start + len(p) for start, p in zip(starts, pending)]
        for _ in range(k - 1):  # q_len 1: each request's latest draft
            step = self.batch.inputs(requests, [[t] for t in drafts[-1]], positions, True)
            logits = self.runner(past_key_values=self.kv_cache, **step)
            drafts.append(logits[0].argmax(-1).tolist())
            positions = [p + 1 for p in positions]
        proposals = [list(column) for column in zip(*drafts)]
        # The cache now holds every token of each request and its first k - 1 drafts.
        self._seen = {id(r): _Seen(len(r.tokens), p[:-1]) for r, p in zip(requests, proposals)}
        return proposals
    # --8<-- [end:propose]


# --8<-- [start:build]
def build_draft(draft_model: Any, target_runner: Any, batch: Any, num_cache_blocks: int, *,
                execute_mode: str = "graph") -> DraftModel:
    """A :class:`DraftModel` of ``draft_model`` (graphmode's model contract,
    the target's vocabulary): its own KV cache and runner, the runner's
    graphs in the target runner's memory pool, q_len 1 and 2."""
    config = target_runner.config
    kv_cache = draft_model.make_kv_cache(num_cache_blocks, config.block_size)
    runner = graphmode.build_graph_runner(
        draft_model, max_batches=config.max_batches, max_blocks_per_seq=config.max_blocks_per_seq,
        block_size=config.block_size, device=config.device, vendor=target_runner.vendor.name,
        execute_mode=execute_mode, max_q_len=2, share_pool_with=target_runner,
    )
    return DraftModel(runner, kv_cache, batch)
# --8<-- [end:build]


def first_layers(target: HuggingFaceModel, layers: int) -> HuggingFaceModel:
    """A draft made of the target's embeddings, first ``layers`` decoder
    layers, final norm and head (weights copied): a smaller config of the
    target's vocabulary. For random-weight runs, where an independently drawn
    draft would never agree with the target; on a trained model it is
    self-speculation by early exit."""
    from transformers import AutoModelForCausalLM

    total = target.config.num_hidden_layers
    if not 1 <= layers < total:
        raise graphmode.ConfigError(
            f"--draft-layers {layers}: the draft takes 1 to {total - 1} of the target's {total} layers"
        )
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = layers
    for name in ("layer_types", "sliding_window_pattern"):  # per-layer lists some configs keep
        if isinstance(getattr(config, name, None), list):
            setattr(config, name, getattr(config, name)[:layers])
    weight = next(target.parameters())
    draft = AutoModelForCausalLM.from_config(config).to(weight.dtype)
    state = target.hf_model.state_dict()
    draft.load_state_dict({name: state[name] for name in draft.state_dict()})
    return HuggingFaceModel(draft.to(weight.device), target.ops)


def check_vocabulary(target: Any, draft: Any) -> None:
    """Refuse a draft whose vocabulary is not the target's."""
    ours, theirs = target.config.vocab_size, draft.config.vocab_size
    if ours != theirs:
        raise graphmode.ConfigError(
            f"the draft model's vocabulary has {theirs} tokens, the target's {ours}: its drafts would be other "
            "tokens' ids. Use a draft model of the target's tokenizer (--draft-model), or --draft-layers N"
        )
