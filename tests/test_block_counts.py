"""Two block counts, two names: the runner's ``max_blocks_per_seq`` (the
width of a block table) and ``make_kv_cache``'s ``num_cache_blocks`` (the
cache's size). ``num_blocks``, the name both had, works for a release with a
DeprecationWarning naming the new one."""

from __future__ import annotations

import warnings

import pytest
import torch

import graphmode
from graphmode.model import ModelConfig, build_reference_model


@pytest.fixture(scope="module")
def model():
    return build_reference_model(ModelConfig.tiny(), device="cpu")


def test_the_runner_takes_max_blocks_per_seq(model):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        runner = graphmode.build_graph_runner(model, max_batches=4, max_blocks_per_seq=6, block_size=16, device="cpu")
    assert runner.config.max_blocks_per_seq == 6


def test_num_blocks_for_the_runner_warns_naming_max_blocks_per_seq(model):
    with pytest.warns(DeprecationWarning, match=r"build_graph_runner\(num_blocks=\.\.\.\) is deprecated .*"
                      r"use build_graph_runner\(max_blocks_per_seq=\.\.\.\)") as caught:
        runner = graphmode.build_graph_runner(model, max_batches=4, num_blocks=6, block_size=16, device="cpu")
    assert caught[0].filename == __file__
    assert runner.config.max_blocks_per_seq == 6
    with pytest.raises(TypeError, match="both num_blocks= .* and max_blocks_per_seq="):
        graphmode.build_graph_runner(model, max_batches=4, num_blocks=6, max_blocks_per_seq=6, block_size=16)


def test_runner_config_num_blocks_warns_and_reads_the_width():
    with pytest.warns(DeprecationWarning, match=r"RunnerConfig\(num_blocks=\.\.\.\) is deprecated"):
        config = graphmode.RunnerConfig(max_batches=4, num_blocks=6, block_size=16, device="cpu")
    assert config == graphmode.RunnerConfig(4, 6, 16, "cpu")
    with pytest.warns(DeprecationWarning, match=r"RunnerConfig\.num_blocks is deprecated .*RunnerConfig\.max_blocks_per_seq"):
        assert config.num_blocks == 6
    with pytest.raises(graphmode.ConfigError, match="max_blocks_per_seq=0: must be a positive integer"):
        graphmode.RunnerConfig(4, 0, 16, "cpu")


def test_make_kv_cache_takes_num_cache_blocks_and_warns_for_num_blocks(model):
    cache = model.make_kv_cache(num_cache_blocks=5, block_size=16)
    with pytest.warns(DeprecationWarning, match=r"make_kv_cache\(num_blocks=\.\.\.\) is deprecated .*"
                      r"make_kv_cache\(num_cache_blocks=\.\.\.\)"):
        old = model.make_kv_cache(num_blocks=5, block_size=16)
    assert len(old) == len(cache) == 2
    assert [k.shape for k, _ in old] == [k.shape for k, _ in cache] and cache[0][0].shape[0] == 5


def test_a_table_wider_than_the_runner_says_which_count_it_is(model):
    """The mix-up the names prevent: a runner built with the cache's size is
    fine, one built with too few columns names its width, not the cache."""
    from graphmode.model.engine import ReferenceEngine

    runner = graphmode.build_graph_runner(model, max_batches=4, max_blocks_per_seq=2, block_size=16, device="cpu")
    engine = ReferenceEngine(num_cache_blocks=32, block_size=16, device="cpu", vocab_size=256, table_width=3)
    cache = model.make_kv_cache(num_cache_blocks=32, block_size=16)
    seq = engine.add()
    step = engine.prefill([seq], [40])
    with pytest.raises(graphmode.InputError, match=r"3 blocks wide, above the runner's max_blocks_per_seq=2 "
                       r"\(the block table's width, not the KV cache's size\)"):
        with torch.inference_mode():
            runner(step.input_ids, step.position_ids, cache, step.attn_metadata)
