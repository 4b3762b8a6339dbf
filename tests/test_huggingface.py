"""Hugging Face models through graphmode: greedy tokens from graph replays on
the CPU emulator equal ``model.generate(do_sample=False)``, for tiny random
Llama, Mistral, Qwen2 and Qwen3 (qk-norm) models loaded from a local
directory, with requests arriving and finishing at different steps, and with
speculative verify steps. The loop under test is ``examples/serve_hf.py``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import graphmode  # noqa: E402
from graphmode.errors import ConfigError, InputError  # noqa: E402
from graphmode.integrations.huggingface import load_model, random_config  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import serve_hf  # noqa: E402

FAMILIES = ["llama-tiny", "mistral-tiny", "qwen2-tiny", "qwen3-tiny"]
BLOCK_SIZE, WIDTH, MAX_BATCH = 4, 8, 4


def make_requests() -> list[serve_hf.Request]:
    """Six requests of different lengths arriving every other step, so the
    batch grows and shrinks (buckets 1, 2 and 4); the repeating prompts give
    the prompt-lookup drafter something to propose."""
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(128, (n,), generator=generator).tolist() for n in (5, 9, 3, 7, 6, 4)]
    prompts[1] = [7, 8, 9, 7, 8, 9, 7, 8, 9]
    prompts[3] = [3, 4, 3, 4, 3, 4, 3]
    return [
        serve_hf.Request(prompt, max_new_tokens=new, arrival=2 * i)
        for i, (prompt, new) in enumerate(zip(prompts, (12, 6, 14, 9, 3, 11)))
    ]


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    """(directory of a random model saved by transformers, HF's greedy tokens
    for every request)."""
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(random_config(request.param)).eval()
    directory = tmp_path_factory.mktemp(request.param)
    reference.save_pretrained(directory)
    expected = []
    for item in make_requests():
        prompt = torch.tensor([item.prompt])
        out = reference.generate(prompt, max_new_tokens=item.max_new_tokens, do_sample=False,
                                 attention_mask=torch.ones_like(prompt), pad_token_id=0)
        expected.append(out[0, prompt.shape[1]:].tolist())
    return directory, expected


def serve(directory, speculate: int):
    model = load_model(directory)
    kv_cache = model.make_kv_cache(MAX_BATCH * WIDTH + 1, BLOCK_SIZE)
    runner = graphmode.build_graph_runner(
        model, max_batches=MAX_BATCH, max_blocks_per_seq=WIDTH, block_size=BLOCK_SIZE, max_q_len=speculate + 1
    )
    batch = serve_hf.PagedBatch(MAX_BATCH * WIDTH + 1, BLOCK_SIZE, WIDTH, torch.device("cpu"))
    requests = make_requests()
    eos = model.config.eos_token_id
    steps = serve_hf.serve(runner, kv_cache, batch, requests, max_batch=MAX_BATCH, speculate=speculate,
                           eos={eos} if isinstance(eos, int) else set(eos or []))
    return [r.output for r in requests], steps, runner.stats


def test_graph_replays_give_hf_greedy_tokens(checkpoint):
    directory, expected = checkpoint
    outputs, steps, stats = serve(directory, speculate=0)
    assert outputs == expected
    # Every decode step was a graph step: captured once per bucket, replayed after.
    assert stats.captures >= 2 and stats.replays >= 10
    assert stats.captures + stats.replays == steps["decode"]
    assert dict(stats.eager_steps) == {"prefill": steps["prefill"]}


def test_verify_steps_give_hf_greedy_tokens(checkpoint):
    directory, expected = checkpoint
    outputs, steps, stats = serve(directory, speculate=3)
    assert outputs == expected
    assert steps["verify"] >= 1 and steps["decode"] >= 1 and steps["accepted"] >= 1
    # Every decode and verify step was a graph step (captured once per
    # (bucket, q_len), replayed after); only prefills ran eagerly.
    assert stats.captures + stats.replays == steps["decode"] + steps["verify"]
    assert dict(stats.eager_steps) == {"prefill": steps["prefill"]}
    verify_replays = sum(n for q_len, n in stats.replays_by_q_len.items() if q_len > 1)
    assert verify_replays >= 1, stats.summary()


def test_sliding_window_beyond_the_table_is_refused():
    """Mistral's window is not applied by the paged kernels: a block table that
    could outgrow it is refused, not computed over the whole sequence."""
    model = load_model(random_config("mistral-tiny", sliding_window=16))
    kv_cache = model.make_kv_cache(MAX_BATCH * WIDTH + 1, BLOCK_SIZE)
    batch = serve_hf.PagedBatch(MAX_BATCH * WIDTH + 1, BLOCK_SIZE, WIDTH, torch.device("cpu"))
    step = batch.step([serve_hf.Request([1, 2, 3], 4)], [[1, 2, 3]], is_decoding=False)
    with pytest.raises(ConfigError, match=r"sliding window of 16 tokens \(config.sliding_window\), but the block table can address 32"):
        model(past_key_values=kv_cache, **step)


def test_adapted_hf_model_called_without_graphmode_says_how():
    model = load_model(random_config("llama-tiny"))
    with pytest.raises(ConfigError, match="call it through graphmode.integrations.huggingface.HuggingFaceModel"):
        model.hf_model(torch.tensor([[1, 2, 3]]), use_cache=False)


def test_load_model_refuses_a_directory_without_a_model(tmp_path):
    with pytest.raises(ConfigError, match="is not a model directory"):
        load_model(tmp_path)


def test_kv_cache_made_elsewhere_is_refused():
    model = load_model(random_config("llama-tiny"))
    other = load_model(random_config("llama-tiny"))
    kv_cache = other.make_kv_cache(9, BLOCK_SIZE)
    batch = serve_hf.PagedBatch(9, BLOCK_SIZE, 2, torch.device("cpu"))
    with pytest.raises(InputError, match="make_kv_cache"):
        model(past_key_values=kv_cache, **batch.step([serve_hf.Request([1], 1)], [[1]], is_decoding=False))


def test_the_example_prints_graphmode_errors_in_one_line(tmp_path, capsys):
    """``serve_hf.py --model DIR`` with no model there: the ConfigError's
    message on stderr and exit status 2, not a traceback."""
    missing = tmp_path / "no-such-dir"
    assert serve_hf.main(["--model", str(missing)]) == 2
    captured = capsys.readouterr()
    assert captured.err == (f"serve_hf.py: {str(missing)!r} is not a model directory (no config.json) nor a .gguf "
                            "file; pass a local HF model directory or GGUF file\n")
