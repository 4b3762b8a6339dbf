"""Vendor plugins: the Ascend update-path switch, error advice and
configuration refusals (more in test_ascend_runtime.py); each vendor's buffers and graph contexts; and
upstream weaknesses done right."""

from __future__ import annotations

import pytest
import torch
from setups import tiny_setup

import graphmode
from graphmode import CaptureError, ConfigError
from graphmode.buckets import FixedSizes, three_stage_sizes
from graphmode.runner.setup import default_capture_sizes
from graphmode.spec import CUDA_SPEC, GraphSpec
from graphmode_ascend.advice import capture_advice
from graphmode_ascend.graph import AscendGraph, resolve_update_path, uses_graph_update
from graphmode_ascend.plugin import AscendOptions

# -- Ascend: which update path -------------------------------------------------


# Real torch_npu version strings (Ascend/pytorch version.txt / setup.py at the
# release tags named) and whether that build's NPUGraph.update records the
# functional FIA call (its graphs.py / handler registry at the tag).
@pytest.mark.parametrize(
    "version, expected",
    [
        ("2.1.0.post16", False),  # v7.1.0.2-pytorch2.1.0
        ("2.1.0.post17", True),  # v7.2.0-pytorch2.1.0
        ("2.1.0.post18", True),  # branch v2.1.0-7.2.0
        ("2.5.1.post3", False),  # v7.1.0.2-pytorch2.5.1 (the line never got the fix)
        ("2.6.0", False),  # v7.1.0-pytorch2.6.0
        ("2.6.0.post2", False),  # v7.1.0.2-pytorch2.6.0
        ("2.6.0.post3", True),  # v7.2.0-pytorch2.6.0
        ("2.6.0.post4", True),  # v7.2.0.1-pytorch2.6.0
        ("2.6.0.post6", True),  # v7.3.1-pytorch2.6.0
        ("2.7.1", False),  # v7.2.RC1.alpha002-pytorch2.7.1 lacks it (v7.2.0's has it: ambiguous)
        ("2.7.1.post1", True),  # v7.2.0.1-pytorch2.7.1
        ("2.7.1.post3", True),  # v7.3.1-pytorch2.7.1
        ("2.7.1.post6", True),  # branch v2.7.1-26.0.0 (handler registry)
        ("2.7.1.post10", True),  # branch v2.7.1-26.1.0
        ("2.8.0", False),  # v7.2.RC1.alpha002-pytorch2.8.0 lacks it (ambiguous, as 2.7.1)
        ("2.8.0rc1", False),
        ("2.8.0.post1", True),  # v7.2.0.1-pytorch2.8.0
        ("2.8.0.post5", True),  # branch v2.8.0-26.0.0
        ("2.8.0.post1+git4b2c", True),
        ("2.9.0", True),  # v7.2.RC1.alpha003-pytorch2.9.0, v7.3.0-pytorch2.9.0
        ("2.9.0.post7", True),  # v26.2.0-beta.1-pytorch2.9.0
        ("2.10.0.post5", True),  # v26.2.0-beta.1-pytorch2.10.0
        ("2.12.0", True),  # v26.1.0-pytorch2.12.0
        ("2.13.0", True),  # v26.2.0-0day-pytorch2.13.0
        ("2.14.0", True),  # the PyPI wheel: torch_npu/npu/graphs.py and _npugraph_handlers as 2.13.0's
        ("unknown", False),
        ("", False),
    ],
)
def test_torch_npu_version_decides_the_update_path(version, expected):
    assert uses_graph_update(version) is expected


def test_update_path_resolution(monkeypatch):
    monkeypatch.delenv("GRAPHMODE_ASCEND_UPDATE_PATH", raising=False)
    assert resolve_update_path("auto", "2.9.0") == "graph_update"
    assert resolve_update_path("auto", "2.7.1") == "task_group"
    assert resolve_update_path("auto", "2.6.0.post4") == "graph_update"
    assert resolve_update_path("auto", "nonsense") == "task_group"
    assert resolve_update_path("auto", None) == "graph_update"  # the emulator mirrors the current API
    assert resolve_update_path("task_group", "2.9.0") == "task_group"
    monkeypatch.setenv("GRAPHMODE_ASCEND_UPDATE_PATH", "task_group")
    assert resolve_update_path("graph_update", "2.9.0") == "task_group"
    monkeypatch.setenv("GRAPHMODE_ASCEND_UPDATE_PATH", "fast")
    with pytest.raises(ConfigError, match="Ascend update_path='fast' is not one of auto, graph_update, task_group"):
        resolve_update_path(None, "2.9.0")


@pytest.mark.parametrize("path", ["graph_update", "task_group"])
def test_each_update_path_pushes_new_lengths_into_the_graph(path, monkeypatch):
    monkeypatch.setenv("GRAPHMODE_ASCEND_UPDATE_PATH", path)
    setup = tiny_setup("ascend")
    seqs = setup.prefill(3, [2, 9, 17])
    for _ in range(4):
        graph, eager = setup.decode(seqs)
        torch.testing.assert_close(graph, eager)
    captured = setup.runner.graph(4).graph
    assert isinstance(captured, AscendGraph) and captured.update_path == path
    if path == "graph_update":
        assert captured.npu_graph.num_updatable == setup.model.config.num_hidden_layers
    else:
        assert len(captured._capture.tasks) == setup.model.config.num_hidden_layers


# -- Ascend: the capture list ---------------------------------------------------


def test_ascend_capture_list_for_256_is_the_three_stage_list():
    assert list(default_capture_sizes(graphmode.load_vendor("ascend"), 256)) == three_stage_sizes(256)


# -- Ascend: capture errors become advice --------------------------------------


@pytest.mark.parametrize(
    "message, advice",
    [
        ("ACL error 207008: stream resources exhausted", "ran out of NPU streams"),
        ("error code is 207008\n[Error]: Stream resources are insufficient.", "ran out of NPU streams"),
        ("rtStreamCreate: alloc sq cq fail", "the Ascend driver (HDK) is too old"),
    ],
)
def test_known_capture_errors_become_advice(message, advice):
    result = capture_advice(RuntimeError(message), bucket=48, captured=1, asked=(1, 2, 4, 48))
    assert isinstance(result, CaptureError) and advice in str(result)


def test_unknown_capture_errors_are_left_alone():
    assert capture_advice(RuntimeError("out of memory"), bucket=4, captured=0, asked=(4,)) is None


def test_the_runner_raises_the_advice_from_the_original_error():
    def model(input_ids, position_ids, past_key_values, attn_metadata):
        if torch.is_grad_enabled() is False and graphmode.emulator.current_session() is not None:
            raise RuntimeError("ACL error 207008: Stream resources are insufficient.")
        return input_ids[..., None].float()

    setup = tiny_setup("ascend")
    runner = graphmode.build_graph_runner(model, max_batches=4, max_blocks_per_seq=8, block_size=16, device="cpu", vendor="ascend")
    step = setup.engine.decode(setup.prefill(2))
    with pytest.raises(CaptureError, match="capturing bucket 2 ran out of NPU streams") as error:
        runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata)
    assert str(error.value.__cause__) == "ACL error 207008: Stream resources are insufficient."


# -- Ascend: configuration refusals --------------------------------------------


def test_ascend_refuses_launch_blocking_with_graphs(monkeypatch):
    monkeypatch.setenv("ASCEND_LAUNCH_BLOCKING", "1")
    with pytest.raises(ConfigError, match="ASCEND_LAUNCH_BLOCKING=1 makes every NPU launch synchronous"):
        tiny_setup("ascend")
    for mode in ("piecewise", "full_and_piecewise"):  # segment graphs are captured too
        with pytest.raises(ConfigError, match="ASCEND_LAUNCH_BLOCKING=1"):
            tiny_setup("ascend", execute_mode=mode)
    assert tiny_setup("ascend", execute_mode="eager").runner.config.execute_mode == "eager"


def test_ascend_refuses_unknown_and_bad_options():
    with pytest.raises(ConfigError, match=r"unknown vendor_options \['stream_budgt'\] for vendor 'ascend'; its options \(AscendOptions\) are \['update_path'\]"):
        tiny_setup("ascend", vendor_options={"stream_budgt": 10})


# -- each vendor's buffers -----------------------------------------------------


def _filled(vendor: str, batch: int = 3):
    setup = tiny_setup(vendor, capture_batch_sizes=[1, 2, 4, 8, 16])  # batch 3 pads to 4
    step = setup.engine.decode(setup.prefill(batch))
    meta = setup.runner.graph_meta()
    bucket = setup.runner.bucket_of(batch)
    with torch.inference_mode():
        setup.runner.vendor.hook.graphmode_fill_buffers(meta=meta, inputs=step, batch_size=batch, bucket=bucket)
        static = setup.runner.vendor.hook.graphmode_update_context(meta=meta, inputs=step, batch_size=batch, bucket=bucket)
    return meta, static, step


def test_ascend_buffers_follow_the_ascend_kernels():
    meta, static, step = _filled("ascend")
    buffers = meta.input_buffers
    assert buffers["input_ids"].dtype == buffers["position_ids"].dtype == torch.int32
    assert buffers["kv_start_indices"].dtype == torch.int32 and buffers["kv_start_indices"].shape == (16,)
    assert graphmode.emulator.is_host(buffers["kv_seqlens"]) and graphmode.emulator.is_host(buffers["q_seqlens"])
    assert buffers["q_seqlens"][:4].tolist() == [1, 2, 3, 4]  # cumulative, host
    assert buffers["kv_seqlens"][:3].tolist() == step.attn_metadata.kv_seqlens.tolist()
    assert buffers["kv_start_indices"][:4].tolist() == step.attn_metadata.kv_start_indices.tolist() + [-1]
    assert static.attn_metadata.x_active_mask.tolist() == [True, True, True, False]
    assert static.attn_metadata.kv_seqlens_cpu.data_ptr() == buffers["kv_seqlens"].data_ptr()


def test_camb_buffers_and_context():
    meta, static, step = _filled("camb")
    slots = meta.input_buffers["kv_start_indices"]
    assert slots.shape == (16,) and slots.dtype == torch.int32 and slots[3:].eq(-1).all()
    assert static.attn_metadata.max_q_seq_len == -1 and static.attn_metadata.max_kv_seq_len == -1


@pytest.mark.parametrize("vendor, kv_padding", [("maca", 0), ("ppu", 1)])
def test_maca_and_ppu_keep_a_slot_column(vendor, kv_padding):
    meta, static, step = _filled(vendor)
    slots = meta.input_buffers["kv_start_indices"]
    assert slots.shape == (16, 1) and slots.dtype == torch.int64
    assert slots[:3, 0].tolist() == step.attn_metadata.kv_start_indices.tolist() and slots[3:].eq(-1).all()
    assert meta.input_buffers["kv_seqlens"][3:].eq(kv_padding).all()
    assert static.attn_metadata.kv_start_indices.shape == (4, 1)


def test_camb_refuses_other_block_sizes():
    with pytest.raises(ConfigError, match="block_size=64: vendor 'camb' takes KV-cache blocks of 16 tokens"):
        tiny_setup("camb", block_size=64)


@pytest.mark.parametrize("vendor", ["maca", "camb"])
def test_padding_is_reset_after_a_larger_batch_unlike_upstream(vendor):
    setup = tiny_setup(vendor)
    seqs = setup.prefill(8)
    meta = setup.runner.graph_meta()
    with torch.inference_mode():
        large = setup.engine.decode(seqs)
        setup.runner.vendor.hook.graphmode_fill_buffers(meta=meta, inputs=large, batch_size=8, bucket=8)
        small = setup.engine.decode(seqs[:5])
        setup.runner.vendor.hook.graphmode_fill_buffers(meta=meta, inputs=small, batch_size=5, bucket=8)
    slots = meta.input_buffers["kv_start_indices"].reshape(16, -1)
    assert slots[5:8].eq(-1).all() and meta.input_buffers["block_offsets"][5:8].eq(0).all()


def test_ppu_fill_reads_nothing_on_the_host():
    """Upstream PPU called .item() while filling; here filling inside a
    capture session would raise on any host read of device memory."""
    setup = tiny_setup("ppu")
    step = setup.engine.decode(setup.prefill(3))
    meta = setup.runner.graph_meta()
    graph = graphmode.emulator.EmulatedGraph()
    with torch.inference_mode(), graph.capture():
        setup.runner.vendor.hook.graphmode_fill_buffers(meta=meta, inputs=step, batch_size=3, bucket=4)


# -- detection -----------------------------------------------------------------


@pytest.mark.parametrize(
    "vendor, reason",
    [
        ("ascend", "torch_npu"),
        ("camb", "torch_mlu"),
        ("maca", "CUDA-compatible device" if not torch.cuda.is_available() else "MetaX"),
        ("ppu", "CUDA-compatible device" if not torch.cuda.is_available() else "PPU"),
    ],
)
def test_vendors_say_why_they_are_not_detected(vendor, reason):
    info = graphmode.load_vendor(vendor).info
    assert info.name == vendor and not info.detected and reason in info.reason


# -- device graphs and process-group backends ----------------------------------


@pytest.mark.parametrize(
    "vendor, kind",
    [("cuda", "EmulatedGraph"), ("maca", "EmulatedGraph"), ("camb", "EmulatedGraph"), ("ascend", "AscendGraph")],
)
def test_graphmode_make_graph_on_the_cpu(vendor, kind):
    meta = graphmode.GraphMeta(max_batchs=4, max_tokens=4, num_blocks=2, block_size=16, device="cpu",
                               vendor_options=AscendOptions(update_path="graph_update"))
    graph = graphmode.load_vendor(vendor).hook.graphmode_make_graph(meta=meta)
    assert type(graph).__name__ == kind


@pytest.mark.parametrize(
    "vendor, device, backend",
    [("cuda", "cpu", "gloo"), ("cuda", "cuda", "nccl"), ("ascend", "cpu", "gloo"), ("camb", "cpu", "gloo")],
)
def test_graphmode_dist_backend(vendor, device, backend):
    assert graphmode.load_vendor(vendor).hook.graphmode_dist_backend(device=torch.device(device)) == backend


# -- a declared largest graph -------------------------------------------------


def test_graphmode_vendors_shows_a_vendors_largest_graph(capsys):
    from plugins.fixed_capture_list import plugin

    from graphmode.cli.vendors import _describe

    _describe(graphmode.load_vendor("fixed", plugin=plugin), 256)
    assert (  # the declaration it made: a fixed list, no max_capture_size
        "capture list for max_batches=256: 6 graphs [1, 2, 4, 8, 16, 32]; largest graph 32 "
        "(the last size of GraphSpec.capture_policy=FixedSizes((1, 2, 4, 8, 16, 32))); batches 33..256 run eagerly"
    ) in capsys.readouterr().out


@pytest.mark.parametrize("spec, named", [
    (lambda: CUDA_SPEC.replace(max_capture_size=24), "largest graph 24 (GraphSpec.max_capture_size); batches 25..256"),
    (lambda: CUDA_SPEC.replace(capture_policy=FixedSizes((1, 2, 4, 8, 16, 32)), max_capture_size=16),
     "largest graph 16 (GraphSpec.max_capture_size); batches 17..256"),
], ids=["max_capture_size", "a fixed list capped lower"])
def test_graphmode_vendors_names_a_declared_max_capture_size(capsys, spec, named):
    from graphmode.cli.vendors import _describe

    class Capped:
        __version__ = "0.1.0"

        @graphmode.hookimpl
        def graphmode_graph_spec(self) -> GraphSpec:
            return spec()

    _describe(graphmode.load_vendor("capped", plugin=Capped()), 256)
    assert named in capsys.readouterr().out
