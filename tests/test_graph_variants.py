"""Graph variants (``graph_variants``) and the batched LoRA reference
(``graphmode.model.lora``), on the CPU emulator: each variant value gets its
own graphs in every family, sharing the pool and the buffers; a step with
every variant at its default replays the plain graphs and is counted so; an
undeclared value is refused naming it. The graph-equals-eager tests run on
CUDA too where a GPU is present (the ``device`` fixture). Every vendor's LoRA
graphs are checked against eager by the conformance suite
(``graphmode_conformance.variants``)."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
import torch
from setups import tiny_setup

import graphmode
from graphmode.errors import ConfigError, InputError
from graphmode.model.lora import add_lora, batched_lora
from graphmode.spec import SEQUENCES, TOKENS, BufferSpec

GRAPH_MODES = ["graph", "piecewise", "full_and_piecewise"]


def test_batched_lora_is_each_rows_own_adapter():
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 8, 2, generator=generator), torch.randn(4, 2, 6, generator=generator)
    x = torch.randn(6, 8, generator=generator)  # 3 sequences of 2 tokens
    ids = torch.tensor([2, 0, 3], dtype=torch.int32)
    expected = torch.cat([x[2 * i:2 * i + 2] @ a[int(j)] @ b[int(j)] for i, j in enumerate(ids)])
    torch.testing.assert_close(batched_lora(x, ids, a, b), expected)
    per_token = ids.repeat_interleave(2)
    torch.testing.assert_close(batched_lora(x, per_token, a, b), expected)


def _lora_setup(mode: str = "graph", per_token: bool = False, device: torch.device | str = "cpu", **options):
    """A tiny setup whose model has 3 adapters, and a runner of ``mode`` with
    lora_ids declared (per sequence, or per token) and the "lora" variant."""
    if mode != "graph":
        options.update(capture_token_sizes=[2, 4, 8])
    setup = tiny_setup(capture_batch_sizes=[2, 4, 8], device=str(device))
    model = add_lora(setup.model, count=3, rank=2, seed=1)
    lora_ids = BufferSpec("lora_ids", torch.int32, shape=(TOKENS,) if per_token else (SEQUENCES,), padding=0)
    runner = graphmode.build_graph_runner(
        model, max_batches=16, max_blocks_per_seq=8, block_size=16, device=device, capture_batch_sizes=[2, 4, 8],
        execute_mode=mode, step_inputs=[lora_ids], graph_variants={"lora": (False, True)}, **options,
    )
    return setup, model, runner


def _step(setup, model, runner, seqs, adapters, lora, per_token=False, prefill=None):
    """One step of ``seqs`` (decode, or a prefill of ``prefill`` tokens each)
    through the runner and eagerly; ``adapters`` per sequence."""
    step = setup.engine.prefill(seqs, prefill) if prefill else setup.engine.decode(seqs)
    ids = torch.tensor(adapters, dtype=torch.int32)
    if per_token:
        ids = ids.repeat_interleave(step.attn_metadata.q_seqlens.cpu())
    ids = ids.to(step.input_ids.device)
    with torch.inference_mode():
        graph = runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata,
                       lora_ids=ids, lora=lora).clone()
        eager = model(step.input_ids, step.position_ids, setup.eager_cache, step.attn_metadata, lora_ids=ids, lora=lora)
    return graph, eager


def test_adapters_change_the_output_and_adapter_zero_is_none():
    setup, model, runner = _lora_setup()
    step = setup.engine.prefill([setup.engine.add() for _ in range(3)], [5, 2, 7])
    call = dict(input_ids=step.input_ids, position_ids=step.position_ids, past_key_values=setup.eager_cache,
                attn_metadata=step.attn_metadata)
    with torch.inference_mode():
        plain = model(**call)
        none = model(**call, lora_ids=torch.zeros(3, dtype=torch.int32), lora=True)
        mixed = model(**call, lora_ids=torch.tensor([0, 2, 0], dtype=torch.int32), lora=True)
        per_token = model(**call, lora_ids=torch.tensor([0] * 5 + [2] * 2 + [0] * 7, dtype=torch.int32), lora=True)
    torch.testing.assert_close(none, plain)
    torch.testing.assert_close(mixed[:, :5], plain[:, :5])  # sequence 0: no adapter
    assert not torch.allclose(mixed[:, 5:7], plain[:, 5:7], atol=1e-4)  # sequence 1: adapter 2
    torch.testing.assert_close(mixed, per_token)  # per-sequence ids of a prefill, expanded from q_seqlens


@pytest.mark.parametrize("mode", GRAPH_MODES)
def test_lora_graphs_equal_eager_for_mixed_adapters_and_plain_steps_replay_the_plain_graphs(mode, device):
    per_token = mode != "graph"  # piecewise segments see a step as rows of tokens
    setup, model, runner = _lora_setup(mode, per_token, device)
    seqs = [setup.engine.add() for _ in range(6)]
    _step(setup, model, runner, seqs, [0, 1, 2, 0, 3, 1], True, per_token, prefill=[3, 9, 1, 17, 5, 2])  # eager: 37 tokens
    steps = [
        ([0, 1, 2, 0, 3, 1], True), ([0, 0, 0, 0, 0, 0], False), ([2, 0, 1, 0, 0, 3], True),
        ([0, 0, 0, 0, 0, 0], False), ([1, 2, 0], True), ([0, 0, 0], False), ([3, 0, 0, 2, 0, 1], True),
    ]
    for adapters, lora in steps:
        graph, eager = _step(setup, model, runner, seqs[:len(adapters)], adapters, lora, per_token)
        torch.testing.assert_close(graph, eager)
    if mode != "graph":  # a prefill of mixed adapters in piecewise graphs
        graph, eager = _step(setup, model, runner, [setup.engine.add(), setup.engine.add()], [2, 1], True,
                             per_token, prefill=[3, 2])
        torch.testing.assert_close(graph, eager)
    stats = runner.stats
    # Buckets 8 and 4 (full) or token buckets 8 and 4 (piecewise): each variant captures both, then replays.
    assert stats.replays_by_variant == {"plain": 1, "lora=True": 2 + (mode == "piecewise")}, stats.summary()
    if mode == "piecewise":
        assert runner.family("piecewise").graph(8) is not runner.family("piecewise").graph(8, lora=True) is not None
    else:
        plain, lora = runner.graph(8), runner.graph(8, lora=True)
        assert plain is not None and lora is not None and plain is not lora
        assert plain.graph.pool() == lora.graph.pool()  # one pool (a token: a tuple of ids on CUDA)
        assert plain.meta.input_buffers["lora_ids"] is lora.meta.input_buffers["lora_ids"]  # one set of buffers
        assert lora.name == "bucket 8, lora=True"
    assert f"graph replays by variant: 1 plain, {2 + (mode == 'piecewise')} lora=True" in stats.summary()


def test_per_sequence_ids_with_an_unknown_longest_query_follow_q_seqlens():
    """max_q_seq_len=-1 (unknown) proves nothing about the lengths: 8 tokens
    of 2 sequences (5 + 3) are expanded from q_seqlens, not grouped 4 and 4."""
    setup, model, _ = _lora_setup()
    step = setup.engine.prefill([setup.engine.add(), setup.engine.add()], [5, 3])
    attn = step.attn_metadata.replace(max_q_seq_len=-1, max_kv_seq_len=-1)
    call = dict(input_ids=step.input_ids, position_ids=step.position_ids, past_key_values=setup.eager_cache,
                lora=True)
    with torch.inference_mode():
        per_sequence = model(**call, attn_metadata=attn, lora_ids=torch.tensor([1, 2], dtype=torch.int32))
        per_token = model(**call, attn_metadata=attn, lora_ids=torch.tensor([1] * 5 + [2] * 3, dtype=torch.int32))
    torch.testing.assert_close(per_sequence, per_token)


@pytest.mark.parametrize("mode", ["eager", *GRAPH_MODES])
def test_an_undeclared_variant_value_is_refused_naming_it(mode):
    setup, model, runner = _lora_setup(mode)
    step = setup.engine.decode(setup.prefill(2, [9, 9]))  # the prefill: eager in every mode (18 tokens)
    with torch.inference_mode(), pytest.raises(InputError) as refused:
        runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata,
               lora_ids=torch.tensor([1, 2], dtype=torch.int32), lora="yes")
    message = str(refused.value)
    assert "lora='yes' is not declared" in message and "(False, True)" in message
    assert "graph_variants={'lora': (False, True, 'yes')}" in message  # the fix


@pytest.mark.parametrize("value, what", [(torch.tensor(True), "a torch.bool tensor of shape ()"),
                                         ([True], "a list, which is not hashable")])
def test_a_tensor_or_unhashable_variant_value_is_refused_with_a_fix_that_works(value, what):
    """An engine may compute the flag on the device (``(ids != 0).any()``):
    the fix is a host value, not declaring the tensor (which the declaration
    refuses)."""
    setup, model, runner = _lora_setup()
    step = setup.engine.decode(setup.prefill(2, [3, 4]))
    with torch.inference_mode(), pytest.raises(InputError) as refused:
        runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata,
               lora_ids=torch.tensor([1, 2], dtype=torch.int32), lora=value)
    message = str(refused.value)
    assert f"graph variant lora is {what}" in message, message
    assert "pass one of the declared host values (False, True)" in message and "graph_variants=" not in message


def test_a_value_equal_to_a_declared_one_runs_its_graphs_and_the_model_gets_the_declared_object():
    """Values match as dict keys do (``1 == True``, ``numpy.True_ == True``):
    ``lora=1`` replays the ``lora=True`` graph, and the model receives ``True``."""
    setup, model, runner = _lora_setup()
    seqs = setup.prefill(2, [3, 4])
    for value in (True, 1):
        step = setup.engine.decode(seqs)
        with torch.inference_mode():
            runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata,
                   lora_ids=torch.tensor([1, 2], dtype=torch.int32), lora=value)
    assert runner.stats.captures == 1 and runner.stats.replays_by_variant == {"lora=True": 1}
    assert runner.graph(2, lora=True).extras["lora"] is True


def test_float_ids_are_refused_rather_than_truncated_into_the_int_buffer():
    """A graph step copied float ids into the int32 buffer (1.7 -> adapter 1)
    where an eager step's ``index_select`` refuses them: refused in both,
    naming the dtypes and the fix."""
    setup, model, runner = _lora_setup()
    seqs = setup.prefill(2, [3, 4])
    for step in (setup.engine.decode(seqs), setup.engine.prefill([setup.engine.add()], [5])):  # graph, eager
        with torch.inference_mode(), pytest.raises(InputError) as refused:
            runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata,
                   lora_ids=torch.tensor([1.7] * step.attn_metadata.q_seqlens.shape[0]), lora=True)
        message = str(refused.value)
        assert "step input 'lora_ids' is torch.float32, declared torch.int32" in message, message
        assert ".to(torch.int32)" in message
    assert runner.stats.captures == 0


@pytest.mark.parametrize("bad", [4, -1])
def test_an_id_past_the_adapters_is_refused_by_an_eager_step_and_fails_a_replay(bad):
    """Adapters 1..3: id 4 (or -1) would be another adapter's weights if
    anything wrapped it. An eager step with host ids refuses it naming the
    id, its sequence and the limit; a graph replay cannot read the ids, and
    its index_select fails (on a GPU, a device-side assert): never a result."""
    setup, model, runner = _lora_setup()
    seqs = setup.prefill(2, [3, 4])
    step = setup.engine.prefill([setup.engine.add()], [5])  # eager
    with torch.inference_mode(), pytest.raises(InputError) as refused:
        runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata,
               lora_ids=torch.tensor([bad], dtype=torch.int32), lora=True)
    message = str(refused.value)
    assert f"lora_ids holds {bad} (sequence or token 0), outside 0..3" in message, message
    assert "add_lora(model, count=" in message  # the fix
    ids = torch.tensor([1, bad], dtype=torch.int32)
    with torch.inference_mode():
        runner.warmup(setup.graph_cache, progress=False, lora=True)
        step = setup.engine.decode(seqs)
        with pytest.raises(IndexError, match="index out of range"):  # the emulator's replay
            runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata, lora_ids=ids, lora=True)


def test_looking_up_a_graph_by_an_undeclared_variant_keyword_is_refused_in_both_families():
    """``runner.family("piecewise").graph(4, loras=True)`` (a typo) gave the plain
    graph, where ``runner.graph`` refused the keyword."""
    setup, model, runner = _lora_setup("full_and_piecewise", per_token=True)
    for lookup, call in ((runner.graph, "runner.graph(4, 1, "), (runner.family("piecewise").graph, "runner.family('piecewise').graph(4, ")):
        with pytest.raises(InputError) as refused:
            lookup(4, loras=True)
        assert str(refused.value) == (f"{call}loras=...): not a declared graph variant keyword; this runner's "
                                      "are ['lora']"), str(refused.value)
    assert runner.graph(4, lora=True) is None and runner.family("piecewise").graph(4, lora=True) is None


def test_a_step_adding_an_undeclared_keyword_is_told_which_and_how_to_declare_it():
    """A keyword a graph did not capture (the engine forgot to declare it):
    the error names it and the declarations that take a per-step value."""
    setup, model, runner = _lora_setup()
    seqs = setup.prefill(2, [3, 4])
    ids = torch.tensor([1, 2], dtype=torch.int32)
    with torch.inference_mode():
        step = setup.engine.decode(seqs)
        runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata, lora_ids=ids, lora=True)
        step = setup.engine.decode(seqs)  # the graph of bucket 2, lora=True again, with one keyword more
        with pytest.raises(InputError) as refused:
            runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata, lora_ids=ids, lora=True,
                   microbatch=True)
    message = str(refused.value)
    assert "captured with ['lora'] (this step adds ['microbatch'])" in message, message
    assert "graph_variants={'microbatch': (...)}" in message and "step_inputs=[BufferSpec('microbatch'" in message


def test_a_hugging_face_model_refuses_graph_variants_when_the_runner_is_built():
    """The adapter's forward takes no keyword beyond the model contract: a
    declared variant (or step input) reached it at the first step."""
    pytest.importorskip("transformers")
    from graphmode.integrations.huggingface import load_model, random_config

    model = load_model(random_config("llama-tiny"))
    for declared in ({"graph_variants": {"lora": (False, True)}},
                     {"step_inputs": [BufferSpec("lora_ids", torch.int32, shape=(SEQUENCES,), padding=0)]}):
        with pytest.raises(ConfigError, match=r"the Hugging Face adapter's forward takes no keyword beyond the "
                           r"model contract, so .*\['lora(_ids)?'\].*: build the runner without"):
            graphmode.build_graph_runner(model, max_batches=4, max_blocks_per_seq=4, block_size=16, **declared)


def test_a_step_leaving_the_variant_out_runs_its_default():
    setup, model, runner = _lora_setup()
    seqs = setup.prefill(2, [3, 4])
    step = setup.engine.decode(seqs)
    with torch.inference_mode():
        graph = runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata,
                       lora_ids=torch.tensor([1, 2], dtype=torch.int32)).clone()
        eager = model(step.input_ids, step.position_ids, setup.eager_cache, step.attn_metadata)
    torch.testing.assert_close(graph, eager)
    assert runner.graph(2) is not None and runner.graph(2, lora=True) is None


@pytest.mark.parametrize("mode", GRAPH_MODES)
def test_warmup_captures_every_variant_or_the_one_named(mode, device):
    setup, model, runner = _lora_setup(mode, per_token=mode != "graph", device=device)
    with torch.inference_mode():
        runner.warmup(setup.graph_cache, progress=False, lora=False)
    captures = runner.stats.captures + runner.stats.piecewise_captures
    assert captures == 3 * len(runner.families)  # buckets (or token buckets) 8, 4, 2 of the plain variant
    with torch.inference_mode():
        runner.warmup(setup.graph_cache, progress=False)  # the rest: the lora=True variant's
    assert runner.stats.captures + runner.stats.piecewise_captures == 2 * captures
    seqs = setup.prefill(4, [2, 3, 4, 5])
    graph, eager = _step(setup, model, runner, seqs, [1, 0, 3, 2], True, per_token=mode != "graph")
    torch.testing.assert_close(graph, eager)
    assert runner.stats.replays_by_variant["lora=True"] == 1


def test_debug_dumps_of_a_variant_name_it(tmp_path, monkeypatch):
    """$GRAPHMODE_DEBUG_DUMP: a variant's graph is dumped under its own name
    (docs/engines.md, "Debug mode"), not over the plain graph's dump."""
    monkeypatch.setenv("GRAPHMODE_DEBUG_DUMP", str(tmp_path))
    setup, model, runner = _lora_setup(debug=True)
    seqs = [setup.engine.add() for _ in range(3)]
    _step(setup, model, runner, seqs, [0, 0, 0], False, prefill=[3, 2, 4])  # eager
    for adapters, lora in (([0, 1, 2], True), ([0, 0, 0], False)):
        graph, eager = _step(setup, model, runner, seqs, adapters, lora)
        torch.testing.assert_close(graph, eager)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bucket4-q1-lora_True.dump", "bucket4-q1.dump"]


@pytest.mark.parametrize(("variants", "error"), [
    ({"lora": ()}, "graph_variants\\['lora'\\] is empty"),
    ({"lora": (0, 1, True)}, "holds equal values"),
    ({"lora": (False, torch.tensor(1))}, "not a tensor"),
    ({"lora_ids": (False, True)}, "also declared in step_inputs"),
    ({"attn_metadata": (False, True)}, "must be a model keyword argument name"),
    (["lora"], "give a dict"),
])
def test_bad_declarations_are_refused(variants, error):
    with pytest.raises(ConfigError, match=error):
        graphmode.RunnerConfig(4, 4, 16, "cpu", step_inputs=(BufferSpec("lora_ids", torch.int32),),
                               graph_variants=variants)


def test_the_engines_doc_shows_graph_variants_as_this_test_runs_them():
    setup = tiny_setup()
    model, engine, cache = setup.model, setup.engine, setup.graph_cache
    seqs = [engine.add() for _ in range(4)]
    step = engine.prefill(seqs, [5, 9, 2, 7])
    with torch.inference_mode():
        model(step.input_ids, step.position_ids, cache, step.attn_metadata)  # eagerly, no adapters
    adapter_of = dict(zip(seqs, [0, 2, 0, 1]))
    with torch.inference_mode():
        # --8<-- [start:graph_variants]
        from graphmode.model.lora import add_lora
        from graphmode.spec import SEQUENCES, BufferSpec

        model = add_lora(model, count=3, rank=8)  # adapters 1, 2, 3 on every layer; id 0: none
        runner = graphmode.build_graph_runner(
            model, max_batches=8, max_blocks_per_seq=8, block_size=16,
            step_inputs=[BufferSpec("lora_ids", torch.int32, shape=(SEQUENCES,), padding=0)],
            graph_variants={"lora": (False, True)},  # a keyword of the model, its default first
        )
        runner.warmup(cache)  # every bucket of both variants, into one pool

        def decode(seqs):
            step = engine.decode(seqs)
            adapters = [adapter_of[s] for s in seqs]  # the scheduler's, on the host
            ids = torch.tensor(adapters, dtype=torch.int32, device=step.input_ids.device)
            return runner(step.input_ids, step.position_ids, cache, step.attn_metadata,
                          lora_ids=ids, lora=any(adapters))  # no adapter in the step: the plain graphs

        mixed = decode(seqs)  # adapters 0, 2, 0, 1 in one batch: bucket 4's lora=True graph
        plain = decode(seqs[::2])  # adapters 0, 0: bucket 2's plain graph
        assert runner.stats.replays_by_variant == {"lora=True": 1, "plain": 1}
        # --8<-- [end:graph_variants]
    assert mixed.shape == (1, 4, model.config.vocab_size) and plain.shape == (1, 2, model.config.vocab_size)
    doc = (Path(__file__).resolve().parent.parent / "docs" / "engines.md").read_text()
    region = re.search(r"# --8<-- \[start:graph_variants\]\n(.*?)\n[ \t]*# --8<-- \[end:graph_variants\]",
                       Path(__file__).read_text(), re.S)
    assert region is not None
    assert f"```python\n{textwrap.dedent(region.group(1)).strip()}\n```" in doc, \
        "docs/engines.md's graph variants block is not this test's region word for word"
