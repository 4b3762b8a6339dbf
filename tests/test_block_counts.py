"""Two block counts, two names: the runner's ``max_blocks_per_seq`` (the
width of a block table) and ``make_kv_cache``'s ``num_cache_blocks`` (the
cache's size)."""

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


def test_runner_config_refuses_a_width_of_zero():
    with pytest.raises(graphmode.ConfigError, match="max_blocks_per_seq=0: must be a positive integer"):
        graphmode.RunnerConfig(4, 0, 16, "cpu")


def test_make_kv_cache_takes_num_cache_blocks(model):
    cache = model.make_kv_cache(num_cache_blocks=5, block_size=16)
    assert len(cache) == 2 and cache[0][0].shape[0] == 5


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
