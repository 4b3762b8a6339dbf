"""GraphMeta and RunnerConfig validate on construction with clear errors."""

from __future__ import annotations

import pytest
import torch

from graphmode import ConfigError, GraphMeta, RunnerConfig


def test_graph_meta_holds_its_sizes():
    meta = GraphMeta(max_batchs=8, max_tokens=8, num_blocks=4, block_size=16, device="cpu")
    assert meta.max_batches == 8 and meta.kv_capacity == 64 and meta.device == torch.device("cpu")
    copy = meta.for_graph()
    assert copy.input_buffers is meta.input_buffers and copy.output_buffers is not meta.output_buffers


@pytest.mark.parametrize("field, value", [("max_batchs", 0), ("num_blocks", -1), ("block_size", 1.5), ("max_tokens", True)])
def test_graph_meta_refuses_bad_sizes(field, value):
    sizes = dict(max_batchs=8, max_tokens=8, num_blocks=4, block_size=16)
    sizes[field] = value
    with pytest.raises(ConfigError, match=f"GraphMeta.{field}={value!r}: must be a positive integer"):
        GraphMeta(device="cpu", **sizes)


def test_graph_meta_needs_a_token_per_sequence():
    with pytest.raises(ConfigError, match="max_tokens=4 is below max_batchs=8"):
        GraphMeta(max_batchs=8, max_tokens=4, num_blocks=4, block_size=16, device="cpu")


def test_runner_config_cleans_the_capture_list():
    config = RunnerConfig(16, 4, 16, "cpu", capture_batch_sizes=[8, 1, 8, 4])
    assert config.capture_batch_sizes == (1, 4, 8)


def test_runner_config_refuses_capture_sizes_beyond_max_batches():
    with pytest.raises(ConfigError, match=r"capture_batch_sizes has \[32\], outside 1..max_batches=16"):
        RunnerConfig(16, 4, 16, "cpu", capture_batch_sizes=[1, 32])


def test_runner_config_refuses_an_empty_capture_list():
    with pytest.raises(ConfigError, match="capture_batch_sizes is empty"):
        RunnerConfig(16, 4, 16, "cpu", capture_batch_sizes=[])


def test_execute_mode_from_the_environment_wins(monkeypatch):
    monkeypatch.setenv("GRAPHMODE_EXECUTE_MODE", "eager")
    assert RunnerConfig(16, 4, 16, "cpu", execute_mode="graph").execute_mode == "eager"
    monkeypatch.setenv("GRAPHMODE_EXECUTE_MODE", "fast")
    with pytest.raises(ConfigError, match=r"\$GRAPHMODE_EXECUTE_MODE='fast' is not an execute mode; use one of graph, piecewise, full_and_piecewise, eager"):
        RunnerConfig(16, 4, 16, "cpu")


def test_unknown_execute_mode_argument():
    with pytest.raises(ConfigError, match="execute_mode='cudagraph' is not an execute mode"):
        RunnerConfig(16, 4, 16, "cpu", execute_mode="cudagraph")


def test_build_graph_runner_takes_every_runner_config_field_as_a_keyword_of_the_same_default():
    import dataclasses
    import inspect

    from graphmode.factory import RUNNER_KEYWORDS, build_graph_runner

    keywords = inspect.signature(build_graph_runner).parameters
    fields = {f.name: f for f in dataclasses.fields(RunnerConfig)}
    assert set(RUNNER_KEYWORDS) == set(fields) - {"head_dim"}
    assert set(RUNNER_KEYWORDS) <= set(keywords)
    for name in RUNNER_KEYWORDS:
        field = fields[name]
        if field.default is not dataclasses.MISSING and name not in ("device", "execute_mode"):
            assert keywords[name].default == field.default, name


def test_runner_sizes_take_integers_of_other_types():
    # An engine's config may hold numpy or torch integers (np.int64(8) read from an array was refused as
    # "not a positive integer"); anything with __index__ is one. A float or a bool is not.
    config = RunnerConfig(max_batches=torch.tensor(8), max_blocks_per_seq=4, block_size=torch.tensor(16), device="cpu")
    assert config.max_batches == 8 and type(config.max_batches) is int and type(config.block_size) is int
    for value in (8.0, True):
        with pytest.raises(ConfigError, match=rf"^max_batches={value!r}: must be a positive integer; pass "
                           r"int\(max_batches\) of at least 1$"):
            RunnerConfig(max_batches=value, max_blocks_per_seq=4, block_size=16, device="cpu")
