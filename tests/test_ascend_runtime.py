"""The Ascend plugin against the runtime behaviour of torch_npu and
vllm-ascend, through the emulated NPU runtime (graphmode_ascend.emulated_npu):
which attention calls get their kv lengths updated, what the update state
keeps alive, stream exhaustion at capture, the dispatch mode's lifetime and
the stream-error signature."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from setups import tiny_setup

import graphmode
from graphmode import CaptureError, RunnerConfig
from graphmode.buckets import three_stage_sizes
from graphmode.runner.setup import capture_sizes as capture_list
from graphmode.runner.setup import configure
from graphmode_ascend import emulated_npu as npu
from graphmode_ascend.advice import capture_advice
from graphmode_ascend.ops import AscendAttentionOps

PATHS = ["graph_update", "task_group"]


class FormOps(AscendAttentionOps):
    """The reference attention through another operator form than FIA's
    functional one: ``.out``, FIA v2 or paged attention (their stand-ins)."""

    def __init__(self, form: str) -> None:
        self.form = form

    def paged_decode_attention(self, query, k_cache, v_cache, attn, scale):
        batch, heads, head_dim = query.shape
        host = attn.kv_seqlens_cpu if attn.kv_seqlens_cpu is not None else attn.kv_seqlens
        kv_heads, block_size = k_cache.shape[-1] // head_dim, k_cache.shape[1]
        bsh = query.reshape(batch, 1, heads * head_dim)
        ops = torch.ops.graphmode_ascend
        if self.form == "out":
            out = torch.empty_like(bsh)
            ops.fused_infer_attention_score_out(
                bsh, k_cache, v_cache, attn.block_offsets, host.tolist(), heads, kv_heads, scale, block_size, out=out
            )
        elif self.form == "v2":
            out = ops.fused_infer_attention_score_v2(
                bsh, k_cache, v_cache, attn.block_offsets, host.tolist(), heads, kv_heads, scale, block_size
            )
        else:
            out = torch.empty_like(query)
            ops.paged_attention(query, k_cache, v_cache, kv_heads, heads, scale, attn.block_offsets, host, out)
        return out.view(batch, heads, head_dim)


def with_form(setup, form: str):
    for layer in setup.model.layers:
        layer.self_attn.ops = FormOps(form)
    return setup


# -- defect 2: only the updated form may be captured ---------------------------


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "form, upstream",
    [
        ("out", "npu_fused_infer_attention_score.out"),
        ("v2", "npu_fused_infer_attention_score_v2"),
        ("paged", "_npu_paged_attention"),
    ],
)
def test_attention_forms_nothing_updates_are_refused_at_capture(path, form, upstream, monkeypatch):
    monkeypatch.setenv("GRAPHMODE_ASCEND_UPDATE_PATH", path)
    setup = with_form(tiny_setup("ascend"), form)
    seqs = setup.prefill(3, [2, 9, 17])
    with pytest.raises(CaptureError, match=f"calls {upstream} ") as error:
        for _ in range(3):
            graph, eager = setup.decode(seqs)
            torch.testing.assert_close(graph, eager)
    assert "graphmode updates the kv lengths of npu_fused_infer_attention_score.default only" in str(error.value)
    assert setup.runner.captured_buckets == []


def test_a_torch_npu_that_records_nothing_is_refused_after_capture(monkeypatch):
    """torch_npu before its .default fix passes FIA's functional form through
    unrecorded: graph.update then changes nothing, silently."""
    monkeypatch.setenv("GRAPHMODE_ASCEND_UPDATE_PATH", "graph_update")
    setup = tiny_setup("ascend")
    seqs = setup.prefill(3, [2, 9, 17])
    with npu.recorded_operators(()):
        with pytest.raises(CaptureError) as error:
            for _ in range(3):
                graph, eager = setup.decode(seqs)
                torch.testing.assert_close(graph, eager)
    assert str(error.value).startswith(
        "torch_npu recorded 0 of the 2 npu_fused_infer_attention_score calls captured, "
        "so graph.update would leave 2 of them with their capture-time kv lengths."
    )
    assert setup.runner.captured_buckets == []


# -- defect 3: what the update state keeps alive --------------------------------


def bytes_kept_by_update_state(setup, bucket: int) -> int:
    """Bytes of capture-allocated memory still alive once the device graph's
    own hold on it (the emulator's recording) and the runner's are dropped:
    what only the Ascend update state keeps alive."""
    captured = setup.runner.graph(bucket)
    graph = captured.graph
    output = captured.meta.output_buffers["output"].untyped_storage().data_ptr()
    allocated = [weakref.ref(t) for t in graph.inner._allocated if t.untyped_storage().data_ptr() != output]
    graph.inner.reset()
    setup.runner.families[0].graphs.clear()  # the full graphs' family
    del captured
    gc.collect()
    alive = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in (r() for r in allocated) if t is not None}
    return sum(alive.values())


@pytest.mark.parametrize("path", PATHS)
def test_the_update_state_keeps_no_captured_tensor_alive(path, monkeypatch):
    monkeypatch.setenv("GRAPHMODE_ASCEND_UPDATE_PATH", path)
    setup = tiny_setup("ascend", max_batches=256, capture_batch_sizes=[256], cache_blocks=600)
    seqs = setup.prefill(200)
    setup.decode(seqs)
    graph = setup.runner.graph(256).graph
    assert graph is not None
    assert bytes_kept_by_update_state(setup, 256) == 0


# -- defect 4: capture what is asked; advice on stream exhaustion ---------------


def capture_sizes(**config) -> list[int]:
    config = RunnerConfig(**{"max_batches": 256, "max_blocks_per_seq": 16, "block_size": 128, "device": "cpu", **config})
    vendor = graphmode.load_vendor("ascend")
    return list(capture_list(vendor, config, configure(vendor, config)))


def test_every_asked_size_is_captured_whatever_the_layer_count():
    assert capture_sizes() == three_stage_sizes(256)
    assert capture_sizes(capture_batch_sizes=(1, 2, 3, 5, 8, 13, 21)) == [1, 2, 3, 5, 8, 13, 21]


def test_stream_exhaustion_says_how_many_graphs_were_captured_and_what_to_set():
    setup = tiny_setup("ascend", max_batches=8, capture_batch_sizes=[1, 2, 4, 8])
    with npu.stream_limit(2), pytest.raises(CaptureError) as error:
        setup.runner.warmup(setup.graph_cache, progress=False)
    assert str(error.value) == (
        "capturing bucket 2 ran out of NPU streams (error 207008, \"Stream resources are insufficient\") after "
        "2 of the 4 graphs asked for were captured. Each captured graph holds NPU streams until it is "
        "freed, and the device has a fixed number. Capture fewer graphs: pass capture_batch_sizes with at most "
        "2 sizes, for example [1, 8], or lower max_batches; HCCL_OP_EXPANSION_MODE=AIV frees the streams HCCL "
        "takes; execute_mode='eager' captures nothing"
    )
    assert "Stream resources are insufficient" in str(error.value.__cause__)
    assert setup.runner.captured_buckets == [8, 4]


@pytest.mark.parametrize("mode", ["piecewise", "full_and_piecewise"])
def test_stream_exhaustion_in_piecewise_modes_names_the_token_sizes_and_counts_pieces(mode):
    """Each token size is one graph per piece (layers + 1 = 3 in the tiny
    model): token bucket 16 took 3 graphs, and 8 ran out. The advice is about
    capture_token_sizes, not batch sizes."""
    setup = tiny_setup(
        "ascend", max_batches=8, capture_batch_sizes=[1, 2, 4, 8], execute_mode=mode,
        capture_token_sizes=[4, 8, 16],
    )
    with npu.stream_limit(4), pytest.raises(CaptureError) as error:
        setup.runner.warmup(setup.graph_cache, progress=False)
    assert str(error.value) == (
        "capturing the piecewise graph of token bucket 8 ran out of NPU streams (error 207008, \"Stream "
        "resources are insufficient\") after 3 graphs were captured (3 of them pieces of piecewise graphs). "
        "In piecewise modes every token size is captured as one graph per piece, about layers + 1 graphs (the "
        "pieces between attention calls), so the 3 token sizes asked for need about 3 x (layers + 1) graphs; "
        "each graph holds NPU streams until it is freed, and the device has a fixed number. Capture fewer "
        "token sizes: pass capture_token_sizes with at most 3 / (layers + 1) sizes (it has 3: [4, 8, 16]), "
        "keeping the largest, or use execute_mode='graph' (one graph per batch size); "
        "HCCL_OP_EXPANSION_MODE=AIV frees the streams HCCL takes; execute_mode='eager' captures nothing"
    )
    assert "capture_batch_sizes" not in str(error.value)
    assert "Stream resources are insufficient" in str(error.value.__cause__)


# -- defect 5: torch_npu's dispatch mode is left on every path -----------------


def test_a_failed_capture_begin_leaves_no_dispatch_mode_behind(monkeypatch):
    monkeypatch.setenv("GRAPHMODE_ASCEND_UPDATE_PATH", "graph_update")
    setup = tiny_setup("ascend")
    seqs = setup.prefill(3, [2, 9, 17])
    with npu.stream_limit(0), pytest.raises(CaptureError, match="ran out of NPU streams"):
        setup.decode(seqs)
    assert torch._C._len_torch_dispatch_stack() == 0
    # Eager attention runs outside any capture, unintercepted.
    step = setup.engine.decode(seqs)
    with torch.inference_mode():
        out = setup.model(step.input_ids, step.position_ids, setup.eager_cache, step.attn_metadata)
    assert out.shape[:2] == step.input_ids.shape and torch.isfinite(out).all()


# -- defect 6: the stream-error signature --------------------------------------


@pytest.mark.parametrize(
    "message, matched",
    [
        (npu.STREAM_ERROR, True),  # torch_npu's NPU_CHECK_ERROR text for 207008
        ("EZ9999: Inner Error! insufficient_stream_resources when capturing", True),  # vllm-ascend's marker
        ("ACL error 207008: stream resources exhausted", True),  # the code with 'stream resource'
        ("NPU out of memory. Tried to allocate 1.20 GiB (1207008 bytes)", False),  # the digits alone
        ("rtStreamCreate: alloc sq cq fail", False),  # the old-HDK signature, advised separately
    ],
)
def test_the_stream_error_matcher_follows_torch_npu_and_vllm_ascend(message, matched):
    advice = capture_advice(RuntimeError(message), bucket=4, captured=1, asked=(4, 8))
    assert (advice is not None and "ran out of NPU streams" in str(advice)) is matched
