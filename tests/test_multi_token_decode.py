"""Multi-token decode graphs: a decode step whose sequences all carry the same
q_len (speculative verify, MTP) replays the graph of (batch bucket, q_len).

On the CPU emulator, for every installed vendor: graph results and KV caches
equal eager ones for q_len 1, 2 and 4 with sequences joining and leaving;
steps of unequal (or unprovable) query lengths run eagerly with their reason;
vendors that cannot take them refuse at configuration time."""

from __future__ import annotations

import pytest
import torch
from setups import tiny_setup

import graphmode
from graphmode import ConfigError, hookimpl
from graphmode.model import ModelConfig, build_reference_model
from graphmode.model.engine import ReferenceEngine
from graphmode.plugins import installed_vendor_names
from graphmode.plugins.info import VendorInfo
from graphmode.spec import CUDA_SPEC

VENDORS = installed_vendor_names()
# The vendors whose decode kernels take several queries per sequence (Camb's does not).
MULTI_TOKEN_VENDORS = [name for name in VENDORS if graphmode.load_vendor(name).spec.max_q_len != 1]


def _churn(setup, q_lens=(1, 2, 4)) -> float:
    """Decode steps of every q_len in turn while sequences join and leave
    (buckets 8, 4, 2 and 1 of the capture list); the largest difference
    between graph and eager logits."""
    worst = 0.0
    seqs = setup.prefill(6)
    for round_ in range(3):
        for q_len in q_lens:
            graph, eager = setup.decode(seqs, q_len)
            worst = max(worst, (graph - eager).abs().max().item())
        # First three finish; then one finishes and one joins each round.
        seqs = seqs[:3] if round_ == 0 else seqs[1:] + setup.prefill(1)
    return worst


@pytest.mark.parametrize("vendor", MULTI_TOKEN_VENDORS)
def test_graphs_equal_eager_for_q_len_1_2_4_with_batch_churn(vendor):
    setup = tiny_setup(vendor, max_batches=8, width=4, max_q_len=4, capture_batch_sizes=[1, 2, 4, 8])
    assert _churn(setup) < 1e-4
    assert setup.caches_close()
    stats = setup.runner.stats
    assert dict(stats.eager_steps) == {"prefill": 3}
    # Each (bucket, q_len) captured once, every later step of it replayed.
    graphs = setup.runner.captured_graphs
    assert {q_len for _, q_len in graphs} == {1, 2, 4} and len(graphs) == len(set(graphs))
    assert stats.captures == len(graphs) and stats.captures + stats.replays == 9
    assert stats.replays_by_q_len[2] >= 1 and stats.replays_by_q_len[4] >= 1


def test_padding_rows_are_neutral_in_every_token():
    """A batch of 3 in bucket 4 with q_len 4: the padding row's 4 tokens write
    nothing and read only the reserved block, whatever it holds; live rows
    equal eager."""
    setup = tiny_setup("cuda", max_batches=4, width=4, max_q_len=4, capture_batch_sizes=[4])
    for cache in (setup.graph_cache, setup.eager_cache):
        for k, v in cache:
            k[0].fill_(float("nan"))  # the reserved block
            v[0].fill_(float("nan"))
    seqs = setup.prefill(3)
    for q_len in (4, 4, 2, 4):
        graph, eager = setup.decode(seqs, q_len)
        assert torch.isfinite(graph).all()
        assert torch.allclose(graph, eager, atol=1e-5, rtol=0)
    assert setup.runner.stats.padded_tokens == 3 * 4 + 2  # one padding row of q_len tokens per step
    owned = torch.tensor(setup.engine.owned_slots())
    for (gk, gv), (ek, ev) in zip(setup.graph_cache, setup.eager_cache):
        for graph_cache, eager_cache in ((gk, ek), (gv, ev)):
            flat_g, flat_e = graph_cache[1:].flatten(0, 1), eager_cache[1:].flatten(0, 1)
            live = owned - setup.engine.block_size  # slots of blocks >= 1, as rows of [1:]
            # Close, not equal: the graph computes keys for the padded batch (8 rows at q_len 2),
            # eager for the live rows (6), and CPU GEMMs may round the two shapes differently.
            # NaN from block 0, or a padding token's write into a live slot, would still fail.
            torch.testing.assert_close(flat_g[live], flat_e[live], atol=1e-5, rtol=1e-5)


def test_decode_kernel_is_causal_among_the_new_tokens():
    """The eager multi-token decode step (paged_decode_attention, graph-safe)
    equals the same tokens run as a prefill chunk (prefill_attention, which
    reads the lengths on the host): each new token sees its own and earlier
    positions only. Mixed query lengths included."""
    config = ModelConfig.tiny()
    model = build_reference_model(config, graphmode.load_vendor("cuda"), "cpu")
    for q_lens in ([3, 3, 3], [1, 4, 2]):
        engine = ReferenceEngine(33, 16, "cpu", vocab_size=config.vocab_size, table_width=4, seed=3)
        cache = model.make_kv_cache(33, 16)
        seqs = [engine.add() for _ in q_lens]
        with torch.inference_mode():
            step = engine.prefill(seqs, [5, 17, 9])
            model(step.input_ids, step.position_ids, cache, step.attn_metadata)
            step = engine.decode(seqs, q_lens)
            decoded = model(step.input_ids, step.position_ids, cache, step.attn_metadata)
            chunk = model(step.input_ids, step.position_ids, cache, step.attn_metadata.replace(is_decoding=False))
        assert torch.allclose(decoded, chunk, atol=1e-5, rtol=0)


def test_mixed_and_unprovable_query_lengths_run_eagerly_with_their_reason():
    setup = tiny_setup("cuda", max_batches=4, width=4, max_q_len=4, capture_batch_sizes=[4])
    seqs = setup.prefill(3)
    graph, eager = setup.decode(seqs, [1, 3, 2])  # unequal: 6 tokens != 3 x max_q_seq_len 3
    assert torch.allclose(graph, eager, atol=1e-5, rtol=0)
    step = setup.engine.decode(seqs, 2)
    unknown = step.attn_metadata.replace(max_q_seq_len=-1)  # 6 tokens, 3 sequences: equal lengths not proved
    with torch.inference_mode():
        graph = setup.runner(step.input_ids, step.position_ids, setup.graph_cache, unknown)
        eager = setup.model(step.input_ids, step.position_ids, setup.eager_cache, unknown)
    assert torch.allclose(graph, eager, atol=1e-5, rtol=0)
    graph, eager = setup.decode(seqs, 4)
    assert torch.allclose(graph, eager, atol=1e-5, rtol=0)
    stats = setup.runner.stats
    assert stats.eager_steps["mixed_q_len"] == 2
    assert stats.captures == 1 and setup.runner.captured_graphs == [(4, 4)]
    assert "mixed_q_len" in graphmode.runner.stats.EAGER_REASONS


def test_q_len_above_max_q_len_runs_eagerly():
    setup = tiny_setup("cuda", max_batches=4, width=4, max_q_len=2, capture_batch_sizes=[4])
    seqs = setup.prefill(2)
    graph, eager = setup.decode(seqs, 3)
    assert torch.allclose(graph, eager, atol=1e-5, rtol=0)
    assert setup.runner.stats.eager_steps["multi_token_decode"] == 1 and setup.runner.stats.captures == 0


def test_default_max_q_len_graphs_one_token_decode_only():
    setup = tiny_setup("cuda", max_batches=4, width=4, capture_batch_sizes=[4])
    seqs = setup.prefill(2)
    setup.decode(seqs, 2)
    setup.decode(seqs)
    assert setup.runner.stats.eager_steps["multi_token_decode"] == 1
    assert setup.runner.captured_graphs == [(4, 1)]
    assert setup.runner.graph_meta().max_tokens == 4


def test_warmup_captures_every_q_len_and_steps_replay():
    setup = tiny_setup("cuda", max_batches=4, width=4, max_q_len=3, capture_batch_sizes=[2, 4])
    setup.runner.warmup(setup.graph_cache, progress=False)
    assert sorted(setup.runner.captured_graphs) == [(b, q) for b in (2, 4) for q in (1, 2, 3)]
    assert setup.runner.stats.warmup_captures == 6
    seqs = setup.prefill(3)
    for q_len in (3, 1, 2):
        graph, eager = setup.decode(seqs, q_len)
        assert torch.allclose(graph, eager, atol=1e-5, rtol=0)
    assert setup.runner.stats.replays == 3 and setup.runner.stats.captures == 6
    assert setup.caches_close()
    with pytest.raises(ConfigError, match=r"warmup\(q_lens=\[4\]\): \[4\] outside 1..max_q_len=3"):
        setup.runner.warmup(setup.graph_cache, progress=False, q_lens=[4])


def test_host_staging_serves_multi_token_graphs():
    setup = tiny_setup("cuda", max_batches=8, width=4, max_q_len=4, capture_batch_sizes=[2, 4, 8], host_inputs=True)
    assert _churn(setup, q_lens=(4, 1, 2)) < 1e-4
    assert setup.runner.staging is not None and setup.caches_close()


def test_debug_mode_checks_every_token_of_a_multi_token_step():
    setup = tiny_setup("cuda", max_batches=4, width=4, max_q_len=2, capture_batch_sizes=[4], debug=True)
    seqs = setup.prefill(3)
    setup.decode(seqs, 2)  # a good step passes the checks
    step = setup.engine.decode(seqs, 2)
    slots = step.attn_metadata.kv_start_indices.clone()
    slots[3] = slots[2]  # sequence 1's second token writes its first token's slot
    with pytest.raises(graphmode.InputError, match=r"debug mode: token 3 \(sequence 1\) writes slot \d+, but its "
                                                   r"position kv_seqlens-1=\d+ lives at slot"):
        with torch.inference_mode():
            setup.runner(step.input_ids, step.position_ids, setup.graph_cache,
                         step.attn_metadata.replace(kv_start_indices=slots))


def test_full_and_piecewise_runs_mixed_q_len_piecewise():
    setup = tiny_setup("cuda", max_batches=4, width=4, max_q_len=2, capture_batch_sizes=[4],
                       execute_mode="full_and_piecewise", capture_token_sizes=[8, 16])
    seqs = setup.prefill(3)
    for q_lens in (2, [1, 2, 2], 1, [2, 1, 1]):
        graph, eager = setup.decode(seqs, q_lens)
        assert torch.allclose(graph, eager, atol=1e-5, rtol=0)
    stats = setup.runner.stats
    assert stats.replays + stats.captures == 2 and stats.piecewise_captures + stats.piecewise_replays == 2
    assert "mixed_q_len" not in stats.eager_steps


def test_bad_max_q_len_is_refused():
    with pytest.raises(ConfigError, match=r"max_q_len=0: must be a positive integer"):
        tiny_setup("cuda", max_q_len=0)


def test_ascend_refuses_multi_token_graphs_on_the_task_group_path():
    with pytest.raises(ConfigError, match=r"max_q_len=2 with Ascend update_path='task_group'.*graph_update"):
        tiny_setup("ascend", max_q_len=2, vendor_options={"update_path": "task_group"})
    tiny_setup("ascend", max_q_len=2, vendor_options={"update_path": "graph_update"})  # accepted
    tiny_setup("ascend", vendor_options={"update_path": "task_group"})  # one-token decode: accepted


@pytest.mark.parametrize(
    "options, refusal",
    [
        ({"max_q_len": 17}, "max_q_len=17: FIA in TND layout takes at most 16 new tokens per sequence "
                            "(vllm-ascend's TND limit); build the runner with max_q_len <= 16"),
        ({"block_size": 8}, "block_size=8: FIA in TND layout takes paged KV blocks of a multiple of 16 tokens, "
                            "at most 1024; allocate the KV cache with such a block size (128, say)"),
        ({"block_size": 2048}, "block_size=2048: FIA in TND layout takes paged KV blocks"),
        ({"max_batches": 4097}, "max_batches=4097: FIA in TND layout takes at most 4096 sequences; build the "
                                "runner with max_batches <= 4096"),
    ],
)
def test_ascend_refuses_multi_token_graphs_beyond_the_tnd_kernel_limits_at_build_time(options, refusal):
    """FIA in TND layout (op-plugin's constraints, vllm-ascend's q_len limit):
    refused when the runner is built, not at the first multi-token step."""
    model = tiny_setup("ascend").model
    settings = {"max_batches": 8, "max_blocks_per_seq": 4, "block_size": 16, "max_q_len": 4, **options}
    with pytest.raises(ConfigError) as error:
        graphmode.build_graph_runner(model, device="cpu", vendor="ascend", **settings)
    assert str(error.value).startswith(
        f"max_q_len={settings['max_q_len']} with Ascend: decode graphs of several tokens per sequence call FIA "
        "in TND layout, whose limits this runner exceeds: "
    )
    assert refusal in str(error.value)
    # One-token decode (BSH layout) is not bound by them.
    graphmode.build_graph_runner(model, device="cpu", vendor="ascend", **{**settings, "max_q_len": 1})


def test_ascend_tnd_limits_at_their_edges_and_the_head_size():
    from graphmode_ascend.ops import tnd_limit_violations

    def problems(**changes):
        limits = {"max_q_len": 16, "block_size": 1024, "max_batches": 4096, "head_dim": 128, **changes}
        return tnd_limit_violations(**limits)

    assert problems() == [] and problems(block_size=16) == [] and problems(head_dim=None) == []
    assert problems(block_size=1040) and problems(block_size=24) and problems(max_q_len=17)
    assert problems(max_batches=4097)
    (head,) = problems(head_dim=64)
    assert head.startswith("head_dim=64: FIA in TND layout takes heads of 128 (or 192 for query and key with 128")
    # The runner knows the model's head size from its config (the reference model: hidden 64 / 4 heads).
    assert tiny_setup("ascend").runner.config.head_dim == 16


def test_camb_declares_one_query_per_sequence_and_runs_verify_steps_eagerly():
    """torch_mlu_ops' single_query_cached_kv_attn takes one query per
    sequence: a runner asking for multi-token graphs is refused at start-up;
    with the default, verify steps run eagerly, equal to eager."""
    with pytest.raises(ConfigError) as error:
        tiny_setup("camb", max_q_len=4)
    assert str(error.value) == (
        "max_q_len=4: vendor 'camb' graphs decode steps of at most 1 new token(s) per sequence "
        "(GraphSpec.max_q_len): the MLU decode kernel, torch_mlu_ops' single_query_cached_kv_attn, takes one "
        "query per sequence. Build the runner with max_q_len <= 1; longer decode steps then run eagerly"
    )
    setup = tiny_setup("camb", max_batches=4, width=4, capture_batch_sizes=[4])
    seqs = setup.prefill(2)
    graph, eager = setup.decode(seqs, 3)
    assert torch.allclose(graph, eager, atol=1e-5, rtol=0)
    setup.decode(seqs)
    assert setup.runner.stats.eager_steps["multi_token_decode"] == 1
    assert setup.runner.captured_graphs == [(4, 1)]


class _OneTokenVendor:
    """A vendor whose kernels take one query per sequence, declared as data."""

    @staticmethod
    @hookimpl
    def graphmode_vendor_info():
        return VendorInfo(name="one_token", device_types=("cpu",), runtime="none", runtime_version=None,
                          detected=False, reason="test plugin")

    @staticmethod
    @hookimpl
    def graphmode_graph_spec():
        return CUDA_SPEC.replace(max_q_len=1, max_q_len_reason="its decode kernel takes one query per sequence")


def test_a_vendor_declaring_max_q_len_refuses_more():
    with pytest.raises(ConfigError, match=r"max_q_len=3: vendor 'one_token' graphs decode steps of at most 1 "
                                          r"new token\(s\) per sequence \(GraphSpec.max_q_len\): its decode kernel "
                                          r"takes one query per sequence. Build the runner with max_q_len <= 1"):
        tiny_setup("one_token", plugin=_OneTokenVendor(), max_q_len=3)
    tiny_setup("one_token", plugin=_OneTokenVendor())  # max_q_len=1: accepted
