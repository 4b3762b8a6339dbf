"""Models an engine author writes themselves, in the style of vLLM's and
SGLang's model files, handed to the runner as the model contract says
(docs/architecture.md): what graph mode cannot replay is refused at capture,
naming the cause and the fix, and what it can replay equals eager."""

from __future__ import annotations

import re

import pytest
import torch
from setups import tiny_setup
from torch import nn
from torch.utils._pytree import tree_map

import graphmode
from graphmode import CaptureError
from graphmode.model import ModelConfig, build_reference_model
from graphmode.model.engine import ReferenceEngine

MODES = ["graph", "piecewise"]


class Wrapped(nn.Module):
    """A model of its own around the reference decoder's layers: the runner
    sees only this module (``ops`` for the piecewise split, ``make_kv_cache``)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = build_reference_model(ModelConfig.tiny(), "cuda")
        self.ops = self.inner.ops

    def make_kv_cache(self, num_cache_blocks: int, block_size: int) -> list:
        return self.inner.make_kv_cache(num_cache_blocks, block_size)

    def forward(self, input_ids, position_ids, past_key_values, attn_metadata):
        return self.inner(input_ids, position_ids, past_key_values, attn_metadata)


class KeepsLastStep(Wrapped):
    """Mixes the previous step's logits into this step's (a feature kept from
    step to step, as MTP and EAGLE drafts keep hidden states) and counts its
    steps in Python."""

    def __init__(self) -> None:
        super().__init__()
        self.previous: torch.Tensor | None = None
        self.steps = 0

    def forward(self, input_ids, position_ids, past_key_values, attn_metadata):
        logits = super().forward(input_ids, position_ids, past_key_values, attn_metadata)
        if self.previous is not None and self.previous.shape == logits.shape:
            logits = logits + 0.5 * self.previous
        self.previous = logits
        self.steps += 1
        return logits * (1 + 0.01 * self.steps)


class GrowsOnceAndCounts(Wrapped):
    """State a graph does replay: a table grown in Python the first time a
    longer step appears (the warm-up forward grows it, the capture finds it
    grown), and a per-token counter buffer changed in place every step."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.ones(1))
        self.register_buffer("tokens_seen", torch.zeros(()))

    def forward(self, input_ids, position_ids, past_key_values, attn_metadata):
        tokens = input_ids.shape[1]
        if tokens > self.table.shape[0]:
            self.table = torch.linspace(1.0, 2.0, 2 * tokens)
        self.tokens_seen.add_(tokens)
        logits = super().forward(input_ids, position_ids, past_key_values, attn_metadata)
        return logits * self.table[:tokens, None]


class TokensByVocab(Wrapped):
    """Returns (T, vocab) logits, as vLLM's models return (num_tokens, hidden)."""

    def forward(self, input_ids, position_ids, past_key_values, attn_metadata):
        return super().forward(input_ids, position_ids, past_key_values, attn_metadata)[0]


class SamplesInside(Wrapped):
    """Returns the logits and each token's greedy id, (T,), as an engine that
    samples inside its graphs does."""

    def forward(self, input_ids, position_ids, past_key_values, attn_metadata):
        logits = super().forward(input_ids, position_ids, past_key_values, attn_metadata)
        return logits, logits[0].argmax(-1)


def _cloned(leaf):
    return leaf.clone() if isinstance(leaf, torch.Tensor) else leaf


def _run(
    cls: type[Wrapped], mode: str, steps: int = 4, graph_model: Wrapped | None = None, warmup: bool = False,
    **options
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Prefill three sequences, then decode ``steps`` steps through a runner
    (built with ``options``, warmed up first with ``warmup``) over
    ``graph_model`` and through a second copy of the model run eagerly;
    each step's (graph, eager) result."""
    graph_model, eager_model = graph_model or cls(), cls()
    engine = ReferenceEngine(65, 16, "cpu", vocab_size=ModelConfig.tiny().vocab_size, table_width=4, seed=3)
    graph_cache, eager_cache = graph_model.make_kv_cache(65, 16), eager_model.make_kv_cache(65, 16)
    runner = graphmode.build_graph_runner(
        graph_model, max_batches=4, max_blocks_per_seq=4, block_size=16, device="cpu", execute_mode=mode, **options
    )
    if warmup:
        runner.warmup(graph_cache)
    seqs = [engine.add() for _ in range(3)]
    results = []
    for index in range(steps + 1):
        step = engine.prefill(seqs, [5, 9, 3]) if index == 0 else engine.decode(seqs[: 3 - index % 2])
        with torch.inference_mode():
            graph = tree_map(_cloned, runner(step.input_ids, step.position_ids, graph_cache, step.attn_metadata))
            eager = eager_model(step.input_ids, step.position_ids, eager_cache, step.attn_metadata)
        results.append((graph, eager))
    return results


@pytest.mark.parametrize("mode", MODES)
def test_a_forward_that_changes_its_python_state_every_step_is_refused_at_capture(mode):
    # Before: graph steps kept mixing in the logits captured at capture and
    # froze the counter, 3.7 to 5.6 off eager, silently.
    with pytest.raises(CaptureError) as raised:
        _run(KeepsLastStep, mode)
    message = str(raised.value)
    assert "previous (tensor" in message and "steps (2 -> 3)" in message
    assert "in place" in message and "step_inputs=" in message


@pytest.mark.parametrize("mode", MODES)
def test_state_grown_once_and_buffers_changed_in_place_replay_as_eager(mode):
    results = _run(GrowsOnceAndCounts, mode)
    for graph, eager in results:
        torch.testing.assert_close(graph, eager)


class CountsStepsAndFillsOnce(Wrapped):
    """A step counter changed in place at every forward (as the docs tell a
    model to keep such state), and a table filled in place the first time
    the forward runs (lazy initialisation)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros(()))
        self.register_buffer("table", torch.zeros(4))
        self.filled = False

    def forward(self, input_ids, position_ids, past_key_values, attn_metadata):
        if not self.filled:
            self.table.copy_(torch.linspace(1.0, 2.0, 4))
            self.filled = True
        self.steps.add_(1)
        logits = super().forward(input_ids, position_ids, past_key_values, attn_metadata)
        return logits * (1 + 0.1 * self.steps) * self.table[1]


@pytest.mark.parametrize("mode", MODES)
def test_warmup_leaves_state_changed_in_place_as_it_found_it_and_keeps_lazy_initialisation(mode):
    # Before: each warm-up capture's forward advanced the counter (4 buckets), and every later step,
    # the eager prefill included, was 0.96 to 1.1 off the model's own run.
    graph_model = CountsStepsAndFillsOnce()
    results = _run(CountsStepsAndFillsOnce, mode, graph_model=graph_model, warmup=True)
    for graph, eager in results:
        torch.testing.assert_close(graph, eager)
    assert float(graph_model.steps) == len(results)  # the engine's steps, not the warm-up's
    assert graph_model.table.tolist() == torch.linspace(1.0, 2.0, 4).tolist()


class LayersIsACount(Wrapped):
    """Keeps its layer count as ``self.layers``, an int."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = 2


class SharesKVAcrossLayers(Wrapped):
    """Four decoder layers (``self.layers``) over its own cache of two
    (cross-layer KV sharing, as in models that reuse one layer's KV)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Identity() for _ in range(4))


@pytest.mark.parametrize("cls", [LayersIsACount, SharesKVAcrossLayers])
def test_a_cache_is_checked_against_the_models_own_cache_not_its_layers_attribute(cls):
    # Before: an int `layers` failed every step with a bare TypeError (len() of an int), and the
    # sharing model's own cache was refused as having "2 layers, but the model has 4".
    for graph, eager in _run(cls, "graph"):
        torch.testing.assert_close(graph, eager)


class ReturnsPythonValues(Wrapped):
    """Returns the step's token count and KV maximum beside its logits."""

    def forward(self, input_ids, position_ids, past_key_values, attn_metadata):
        logits = super().forward(input_ids, position_ids, past_key_values, attn_metadata)
        return {"logits": logits, "tokens": input_ids.shape[1], "max_kv": attn_metadata.max_kv_seq_len}


@pytest.mark.parametrize("mode", MODES)
def test_a_python_value_in_the_result_is_refused_at_capture(mode):
    # Before: every graph step returned the capture's values (tokens=4, max_kv=-1 for a step of 3 and 5).
    with pytest.raises(CaptureError, match=r"the model's result\['(tokens|max_kv)'\] is int -?\d+, a Python value: a graph "
                                           r"replays the forward's tensor operations only"):
        _run(ReturnsPythonValues, mode)


class LastTokenPerSequence(Wrapped):
    """Returns each sequence's first token's largest logit, (batch,), beside the logits."""

    def forward(self, input_ids, position_ids, past_key_values, attn_metadata):
        logits = super().forward(input_ids, position_ids, past_key_values, attn_metadata)
        return logits, logits[0, attn_metadata.q_start_loc.long()].amax(-1)


def test_a_per_sequence_result_of_a_verify_graph_is_refused_at_capture():
    # Before: 3 sequences of 2 tokens in bucket 4 came back as 4 values, the padding row's last.
    model = LastTokenPerSequence()
    engine = ReferenceEngine(65, 16, "cpu", vocab_size=ModelConfig.tiny().vocab_size, table_width=4, seed=3)
    cache = model.make_kv_cache(65, 16)
    runner = graphmode.build_graph_runner(model, max_batches=4, max_blocks_per_seq=4, block_size=16, device="cpu",
                                          capture_batch_sizes=[1, 2, 4], max_q_len=2)
    seqs = [engine.add() for _ in range(3)]
    with torch.inference_mode():
        step = engine.prefill(seqs, [5, 9, 3])
        runner(step.input_ids, step.position_ids, cache, step.attn_metadata)
        step = engine.decode(seqs, 2)
        with pytest.raises(CaptureError, match=r"the model's result\[1\] has shape \(4,\), one value per sequence "
                                               r"of the graph being captured \(4 sequences, padding rows included, of "
                                               r"2 tokens each\)"):
            runner(step.input_ids, step.position_ids, cache, step.attn_metadata)


class AppendsToHistory(Wrapped):
    """Keeps every step's token count in a Python list (as a scheduler-side
    statistic kept on the model)."""

    def __init__(self) -> None:
        super().__init__()
        self.history: list[int] = []

    def forward(self, input_ids, position_ids, past_key_values, attn_metadata):
        self.history.append(input_ids.shape[1])
        return super().forward(input_ids, position_ids, past_key_values, attn_metadata)


class KeepsLastInADict(Wrapped):
    """KeepsLastStep's previous logits, kept in a dict item rather than an attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: dict[str, torch.Tensor] = {}

    def forward(self, input_ids, position_ids, past_key_values, attn_metadata):
        logits = super().forward(input_ids, position_ids, past_key_values, attn_metadata)
        previous = self.kept.get("logits")
        if previous is not None and previous.shape == logits.shape:
            logits = logits + 0.5 * previous
        self.kept["logits"] = logits
        return logits


class AddsToASet(Wrapped):
    """Numbers its forwards in a set of the call numbers it has seen."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[int] = set()

    def forward(self, input_ids, position_ids, past_key_values, attn_metadata):
        self.seen.add(len(self.seen))
        return super().forward(input_ids, position_ids, past_key_values, attn_metadata)


class ReplacesInAList(Wrapped):
    """Keeps the previous step's mean logit in a list of tensors, mixed into the next step's."""

    def __init__(self) -> None:
        super().__init__()
        self.kept = [torch.ones(()), torch.zeros(())]

    def forward(self, input_ids, position_ids, past_key_values, attn_metadata):
        logits = super().forward(input_ids, position_ids, past_key_values, attn_metadata)
        mixed = logits + self.kept[1]
        self.kept[1] = logits.mean()
        return mixed * self.kept[0]


@pytest.mark.parametrize(("mode", "cls", "name", "change"), [
    pytest.param("graph", AppendsToHistory, "history", r" \(list of (\d+) at (0x[0-9a-f]+) -> list of (?!\1\b)\d+ at \2\)",
                 id="list-append"),
    pytest.param("piecewise", AppendsToHistory, "history", r" \(list of (\d+) at (0x[0-9a-f]+) -> list of ",
                 id="list-append-piecewise"),
    pytest.param("graph", KeepsLastInADict, "kept", r"\['logits'\] \(tensor \(1, \d+, 256\) at 0x[0-9a-f]+ -> tensor ",
                 id="dict-item"),
    pytest.param("graph", AddsToASet, "seen", r" \(set of (\d+) at (0x[0-9a-f]+) -> set of (?!\1\b)\d+ at \2\)",
                 id="set-add"),
    pytest.param("graph", ReplacesInAList, "kept", r"\[1\] \(tensor \(\) at 0x[0-9a-f]+ -> tensor \(\) at 0x",
                 id="tensor-list-element"),
])
def test_a_forward_that_changes_a_container_in_place_is_refused_at_capture(mode, cls, name, change):
    # Before: the list, dict and set kept their identity, so the capture
    # accepted them; graph steps then stopped appending (and
    # KeepsLastInADict and ReplacesInAList mixed in the captured step's
    # logits at every replay, off eager), silently.
    with pytest.raises(CaptureError) as raised:
        _run(cls, mode, steps=1)
    message = str(raised.value)
    assert re.search(re.escape(name) + change, message), message
    assert f"host_bookkeeping=({name!r},)" in message


class ReadsContainers(Wrapped):
    """Python containers the forward only reads, and a dict it fills once per
    token count (the warm-up before each capture fills it): graphs replay these."""

    def __init__(self) -> None:
        super().__init__()
        self.weights = [torch.tensor(0.5), torch.tensor(2.0)]
        self.offsets = {"bias": 0.25, "layers": (1, 2)}
        self.by_tokens: dict[int, torch.Tensor] = {}

    def forward(self, input_ids, position_ids, past_key_values, attn_metadata):
        tokens = input_ids.shape[1]
        if tokens not in self.by_tokens:
            self.by_tokens[tokens] = 1 + 0.01 * torch.arange(tokens)  # a row's value not its step's size
        logits = super().forward(input_ids, position_ids, past_key_values, attn_metadata)
        scaled = logits * self.weights[0] + self.weights[1] * self.offsets["bias"] * len(self.offsets["layers"])
        return scaled * self.by_tokens[tokens][None, :, None]


@pytest.mark.parametrize("mode", MODES)
def test_containers_read_or_filled_once_replay_as_eager(mode):
    for graph, eager in _run(ReadsContainers, mode):
        torch.testing.assert_close(graph, eager)


class CountsForLogging(AppendsToHistory):
    """Host bookkeeping no output depends on: a call counter and a list of token counts."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, input_ids, position_ids, past_key_values, attn_metadata):
        self.calls += 1
        return super().forward(input_ids, position_ids, past_key_values, attn_metadata)


@pytest.mark.parametrize("mode", MODES)
def test_state_declared_host_bookkeeping_is_accepted_and_left_unchanged_by_graph_steps(mode):
    # Before: no way to accept it (and no host_bookkeeping keyword).
    model = CountsForLogging()
    results = _run(CountsForLogging, mode, steps=6, graph_model=model, host_bookkeeping=("calls", "hist*"))
    for graph, eager in results:
        torch.testing.assert_close(graph, eager)
    # Eager and capture forwards counted, graph steps (the replays) not.
    assert model.calls == len(model.history) < len(results)


def test_host_bookkeeping_given_as_one_string_is_refused():
    with pytest.raises(graphmode.ConfigError, match=r"host_bookkeeping='calls': give a tuple .*\('calls',\)"):
        graphmode.build_graph_runner(Wrapped(), max_batches=4, max_blocks_per_seq=4, block_size=16, device="cpu",
                                     host_bookkeeping="calls")


@pytest.mark.parametrize("mode", MODES)
def test_a_result_whose_second_dimension_is_not_the_token_is_refused_at_capture(mode):
    # Before: the graph's (T, vocab) logits came back cut to T columns of the
    # vocabulary ((3, 3) where eager gave (3, 256)), silently.
    with pytest.raises(CaptureError, match=r"shape \(\d+, 256\).*dimension 1.*result\[None\]"):
        _run(TokensByVocab, mode)


@pytest.mark.parametrize("mode", MODES)
def test_a_one_dimensional_per_token_result_is_refused_at_capture(mode):
    # Before: the sampled ids came back uncut, (4,) for a batch of 3 in bucket 4, the padding token's id last.
    with pytest.raises(CaptureError, match=r"result\[1\] has shape \(\d+,\), one value per token .* Return "
                       r"per-token values as \(1, T\): result\[None\]"):
        _run(SamplesInside, mode)


def test_a_make_kv_cache_without_a_device_keyword_still_checks_the_cache():
    # Before: the runner's cache check called make_kv_cache(2, block_size,
    # device="meta") and stopped with a TypeError from inside graphmode.
    model = Wrapped()
    engine = ReferenceEngine(17, 16, "cpu", vocab_size=ModelConfig.tiny().vocab_size, table_width=4)
    runner = graphmode.build_graph_runner(model, max_batches=4, max_blocks_per_seq=4, block_size=16, device="cpu")
    half = [(k.half(), v.half()) for k, v in model.make_kv_cache(17, 16)]
    step = engine.prefill([engine.add()], [5])
    with torch.inference_mode(), pytest.raises(graphmode.InputError, match="dtype torch.float16.*make_kv_cache"):
        runner(step.input_ids, step.position_ids, half, step.attn_metadata)
    step = engine.prefill([engine.add()], [5])
    with torch.inference_mode():
        runner(step.input_ids, step.position_ids, model.make_kv_cache(17, 16), step.attn_metadata)


class ScalesBySlot(Wrapped):
    """Scales each token's logits by a table entry of its cache block, indexed
    with the step's slots outside the attention ops."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("block_scales", torch.linspace(0.5, 1.5, 65))

    def forward(self, input_ids, position_ids, past_key_values, attn_metadata):
        logits = super().forward(input_ids, position_ids, past_key_values, attn_metadata)
        blocks = attn_metadata.kv_start_indices.clamp(min=0) // 16
        return logits * self.block_scales[blocks][None, :, None]


def test_metadata_read_by_indexing_between_attention_calls_is_refused_in_piecewise_capture():
    # Before: indexing with the capture's 'meta' metadata returned whatever
    # memory held, so the first step's answer was garbage (and later replays
    # raised "indices should be either on cpu or on the same device").
    with pytest.raises(CaptureError, match=r"'meta' device.*test_own_models.py:\d+ in forward.*execute_mode='graph'"):
        _run(ScalesBySlot, "piecewise")
    for graph, eager in _run(ScalesBySlot, "graph"):
        torch.testing.assert_close(graph, eager)


class RegrowsOnLongPrompts(Wrapped):
    """A dynamic-NTK-style table: recomputed with other values (and rebound)
    when a step's longest sequence first passes 24 tokens, read from the
    host maximum. A graph context's maximum is -1, so only eager steps regrow."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scales", torch.ones(64))

    def forward(self, input_ids, position_ids, past_key_values, attn_metadata):
        if attn_metadata.max_kv_seq_len > 24 and self.scales[0] == 1:
            self.scales = torch.linspace(0.5, 1.5, 64)
        logits = super().forward(input_ids, position_ids, past_key_values, attn_metadata)
        return logits * self.scales[position_ids[0]][None, :, None]


@pytest.mark.parametrize("mode", MODES)
def test_an_eager_step_that_replaces_a_tensor_the_graphs_hold_refuses_graph_steps_until_reset(mode):
    # Before: the graphs kept reading the old table after the long prefill
    # regrew it, 2.7 to 4.8 off eager, silently (debug mode named it).
    graph_model, eager_model = RegrowsOnLongPrompts(), RegrowsOnLongPrompts()
    engine = ReferenceEngine(65, 16, "cpu", vocab_size=ModelConfig.tiny().vocab_size, table_width=4, seed=3)
    graph_cache, eager_cache = graph_model.make_kv_cache(65, 16), eager_model.make_kv_cache(65, 16)
    runner = graphmode.build_graph_runner(
        graph_model, max_batches=4, max_blocks_per_seq=4, block_size=16, device="cpu", execute_mode=mode
    )

    def both(step):
        with torch.inference_mode():
            graph = tree_map(_cloned, runner(step.input_ids, step.position_ids, graph_cache, step.attn_metadata))
            eager = eager_model(step.input_ids, step.position_ids, eager_cache, step.attn_metadata)
        torch.testing.assert_close(graph, eager)

    seqs = [engine.add() for _ in range(2)]
    both(engine.prefill(seqs, [5, 9]))
    both(engine.decode(seqs))  # captures
    seqs.append(engine.add())
    both(engine.prefill(seqs[2:], [30]))  # eager (no bucket holds 30 tokens): regrows the table
    step = engine.decode(seqs)
    with torch.inference_mode(), pytest.raises(graphmode.ReplayError, match=r"replaced the model's scales.*reset\(\)"):
        runner(step.input_ids, step.position_ids, graph_cache, step.attn_metadata)
    runner.reset()
    both(step)
    both(engine.decode(seqs))


class VllmNamed(Wrapped):
    """A forward with vLLM's parameter names (``positions``, ``kv_caches``)."""

    def forward(self, input_ids, positions, kv_caches, attn_metadata):
        return self.inner(input_ids, positions, kv_caches, attn_metadata)


class TakesKeywords(Wrapped):
    """Accepted: the contract's names reach it through ``*args, **kwargs`` (a decorator's wrapper)."""

    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs)


def test_a_forward_naming_the_contract_parameters_otherwise_is_refused_when_the_runner_is_built():
    # Before: built fine, then the first step failed inside graphmode with a bare
    # "forward() got an unexpected keyword argument 'position_ids'" TypeError.
    with pytest.raises(graphmode.ConfigError, match=r"takes \(input_ids, positions, kv_caches, attn_metadata\).*"
                       r"\['position_ids', 'past_key_values'\].*wrap the model"):
        graphmode.build_graph_runner(VllmNamed(), max_batches=4, max_blocks_per_seq=4, block_size=16, device="cpu")

    class Positional(VllmNamed):
        def forward(self, *args):  # takes no keyword: shown as such (it read "takes ()" before)
            return self.inner(*args)

    with pytest.raises(graphmode.ConfigError, match=r"the model's forward takes \(\*args\) but graphmode calls it"):
        graphmode.build_graph_runner(Positional(), max_batches=4, max_blocks_per_seq=4, block_size=16, device="cpu")
    for graph, eager in _run(TakesKeywords, "graph", steps=1):
        torch.testing.assert_close(graph, eager)


@pytest.mark.parametrize("mode", ["graph", "full_and_piecewise"])
def test_a_forward_that_rebinds_a_metadata_field_replays_right(mode):
    # A model that rebinds attn_metadata.kv_seqlens after its attention: the warm-up forward's rebinding
    # stayed on the context the capture then ran with, so every replay read the warm-up's lengths, frozen
    # (0.49 off eager, the KV cache written wrong; a custom-model hunt, 2026-12-04).
    class Rebinds(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.inner, self.config, self.ops = model, model.config, model.ops

        def forward(self, input_ids, position_ids, past_key_values, attn_metadata):
            logits = self.inner(input_ids, position_ids, past_key_values, attn_metadata)
            attn_metadata.kv_seqlens = attn_metadata.kv_seqlens * 1
            return logits

        def make_kv_cache(self, *args, **kwargs):
            return self.inner.make_kv_cache(*args, **kwargs)

    setup = tiny_setup(capture_batch_sizes=[2, 4, 8])
    model = Rebinds(setup.model)
    runner = graphmode.build_graph_runner(model, max_batches=16, max_blocks_per_seq=8, block_size=16, device="cpu",
                                          execute_mode=mode, capture_batch_sizes=[2, 4, 8], capture_token_sizes=[8])
    seqs = setup.prefill(6)
    for batch in (5, 3, 6, 2, 3, 5):
        step = setup.engine.decode(seqs[:batch])
        with torch.inference_mode():
            graph = runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata.replace()).clone()
            eager = setup.model(step.input_ids, step.position_ids, setup.eager_cache, step.attn_metadata)
        torch.testing.assert_close(graph, eager, atol=1e-5, rtol=1e-5)
    assert setup.caches_close()
    assert runner.stats.replays >= 3


def test_a_scalar_beside_the_logits_comes_back_whole():
    # (logits, a 0-dim tensor): the default outputs hook cut every tensor along dimension 1, and the scalar
    # failed with a bare "too many indices for tensor of dimension 0" (a custom-model hunt, 2026-12-04).
    class WithScale(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.inner, self.config, self.ops = model, model.config, model.ops
            self.register_buffer("scale", torch.tensor(2.0))

        def forward(self, input_ids, position_ids, past_key_values, attn_metadata):
            return self.inner(input_ids, position_ids, past_key_values, attn_metadata), self.scale * 1

        def make_kv_cache(self, *args, **kwargs):
            return self.inner.make_kv_cache(*args, **kwargs)

    setup = tiny_setup(capture_batch_sizes=[2, 4])
    runner = graphmode.build_graph_runner(WithScale(setup.model), max_batches=16, max_blocks_per_seq=8, block_size=16,
                                          device="cpu", capture_batch_sizes=[2, 4])
    seqs = setup.prefill(3)
    for _ in range(2):  # a capture, a replay
        step = setup.engine.decode(seqs)
        with torch.inference_mode():
            logits, scale = runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata)
            eager = setup.model(step.input_ids, step.position_ids, setup.eager_cache, step.attn_metadata)
        torch.testing.assert_close(logits, eager, atol=1e-5, rtol=1e-5)
        assert scale.dim() == 0 and float(scale) == 2.0
