"""Every causal-LM family of the installed transformers through graphmode on
the CPU emulator, against ``generate(do_sample=False)``: one line per family.

    OMP_NUM_THREADS=1 python scripts/hf_families.py                 # every family (about 15 min on 2 cores)
    python scripts/hf_families.py llama qwen3 phi3+longrope         # some; "family+variant" picks FIELDS below

Each family gets a tiny random config (2 layers, hidden 64, 4 heads / 2 KV
heads of 16, vocab 128, 4 experts of which 2 per token, as the family
reads them) plus its FIELDS, and serves three requests twice: arriving at
steps 0, 2 and 4, then all at once (two prompts of different lengths
prefilled in one step), at most 2 decoding at once, through a graph-mode
runner (8 blocks of 4 tokens per sequence). Outcomes:

- ``ok``: the tokens equal ``generate``'s, in both runs;
- ``refused at load|build``: graphmode's ConfigError (its message follows);
- ``DIFFERENT`` or ``CRASH at load|build|serve``: what graphmode must never
  do (a silently different token stream, an error that is not a refusal);
- ``no reference``: transformers itself could not build the tiny model or
  ``generate`` with it (the config needs fields of its own: add them to
  FIELDS), or it took longer than ``--timeout`` (a default-sized vision tower).

Exit status 1 if any family gave DIFFERENT or CRASH. The CI subset is
``tests/test_huggingface_families.py``; this sweep is what chose it.
"""

from __future__ import annotations

import argparse
import copy
import signal
import sys
import time
import traceback
from pathlib import Path

import torch

import graphmode
from graphmode.errors import ConfigError
from graphmode.integrations.huggingface import load_model
from graphmode.integrations.huggingface_support import refuse_config

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import serve_hf  # noqa: E402

BLOCK_SIZE, WIDTH, MAX_BATCH = 4, 8, 2
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=128, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
DROP = "drop"  # a FIELDS value that removes the TINY field (None is passed on: a feature off)
MLA = dict(kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
           num_key_value_heads=4, head_dim=DROP)
ENCODER_DECODER = dict(d_model=64, decoder_layers=2, encoder_layers=2, decoder_attention_heads=4,
                       encoder_attention_heads=4, decoder_ffn_dim=128, encoder_ffn_dim=128, head_dim=DROP,
                       num_key_value_heads=DROP)
LONGROPE = dict(rope_type="longrope", short_factor=[1.0] * 8, long_factor=[4.0] * 8)
#: Fields beyond TINY (DROP removes one). "family+variant" varies a feature.
FIELDS: dict[str, dict] = {
    "codegen": dict(rotary_dim=8, n_inner=128, n_ctx=256, head_dim=DROP),
    "gptj": dict(rotary_dim=8, n_inner=128, head_dim=DROP),
    "falcon": dict(head_dim=DROP), "bloom": dict(head_dim=DROP), "dbrx": dict(head_dim=DROP),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], window_size=32, head_dim=DROP),
    **{name: dict(MLA) for name in ("deepseek_v2", "deepseek_v3", "glm4_moe_lite", "minicpm3", "youtu")},
    "deepseek_v2+same-v": dict(MLA, v_head_dim=24),  # values as wide as keys: the paged cache holds them
    **{name: dict(ENCODER_DECODER) for name in ("bart", "mbart", "marian", "pegasus", "plbart", "blenderbot",
                                                  "blenderbot-small", "mvp", "trocr", "whisper")},
    "llama+rope-linear": dict(rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "llama+rope-dynamic": dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
    "llama+rope-yarn": dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    "llama+rope-llama3": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "llama+bias-tied": dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=True),
    "phi3+longrope": dict(rope_scaling=dict(LONGROPE, original_max_position_embeddings=8),
                          original_max_position_embeddings=8),
    "phi3+longrope-within": dict(rope_scaling=dict(LONGROPE, original_max_position_embeddings=32),
                                 original_max_position_embeddings=32),
    "mistral+window": dict(sliding_window=32),
    "qwen2+window": dict(use_sliding_window=True, sliding_window=32, max_window_layers=1),
    "gemma2+no-softcap": dict(attn_logit_softcapping=None, final_logit_softcapping=30.0, sliding_window=32),
    "gemma3_text+window": dict(sliding_window=32),
    "cohere2+mixed": dict(sliding_window=32, layer_types=["sliding_attention", "full_attention"]),
    "smollm3+nope": dict(no_rope_layers=[1, 0]),
}


class Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise Timeout("over the --timeout")


def requests(arrivals: tuple[int, ...]) -> list[serve_hf.Request]:
    generator = torch.Generator().manual_seed(1)
    return [serve_hf.Request(torch.randint(3, 128, (n,), generator=generator).tolist(), new, arrival=arrival)
            for (n, new), arrival in zip([(5, 6), (9, 4), (3, 7)], arrivals)]


def run(settings, arrivals: tuple[int, ...]) -> tuple[str, str]:
    """(outcome, detail) of one family's config served with ``arrivals``."""
    import transformers

    settings = copy.deepcopy(settings)  # load_model sets its attention implementation on the config
    torch.manual_seed(0)
    stage = "load"
    try:
        refuse_config(settings)  # what load_model refuses first, before a (multimodal) reference is drawn
        stage = "reference"
        reference = transformers.AutoModelForCausalLM.from_config(settings).eval()
        expected = []
        for item in requests(arrivals):
            prompt = torch.tensor([item.prompt])
            out = reference.generate(prompt, max_new_tokens=item.max_new_tokens, do_sample=False,
                                     attention_mask=torch.ones_like(prompt), pad_token_id=0)
            expected.append(out[0, prompt.shape[1]:].tolist())
        eos = reference.generation_config.eos_token_id
        stage = "load"
        model = load_model(settings)
        model.hf_model.load_state_dict(reference.state_dict())
        kv_cache = model.make_kv_cache(MAX_BATCH * WIDTH + 1, BLOCK_SIZE)
        stage = "build"
        runner = graphmode.build_graph_runner(model, max_batches=MAX_BATCH, max_blocks_per_seq=WIDTH,
                                              block_size=BLOCK_SIZE)
        stage = "serve"
        served = requests(arrivals)
        batch = serve_hf.PagedBatch(MAX_BATCH * WIDTH + 1, BLOCK_SIZE, WIDTH, torch.device("cpu"))
        serve_hf.serve(runner, kv_cache, batch, served, max_batch=MAX_BATCH,
                       eos=set(eos if isinstance(eos, list) else [] if eos is None else [eos]))
    except ConfigError as error:
        return f"refused at {stage}", str(error)
    except Exception as error:
        if isinstance(error, Timeout) or stage == "reference":
            return "no reference", f"{type(error).__name__}: {error}"[:300]
        frame = traceback.extract_tb(error.__traceback__)[-1]
        return f"CRASH at {stage}", f"{type(error).__name__}: {error} ({frame.filename}:{frame.lineno})"
    got = [r.output for r in served]
    if got != expected:
        return "DIFFERENT", f"graphmode {got}, generate {expected}"
    return "ok", ""


def main() -> int:
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("families", nargs="*", help="default: every causal-LM family, then the variants of FIELDS")
    parser.add_argument("--timeout", type=int, default=60, help="seconds per family")
    args = parser.parse_args()
    torch.set_num_threads(1)
    families = args.families or [*sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), *(f for f in FIELDS if "+" in f)]
    signal.signal(signal.SIGALRM, _alarm)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}", flush=True)
    bad = 0
    for family in families:
        fields = {**TINY, **FIELDS.get(family, {})}
        start = time.perf_counter()
        signal.alarm(args.timeout)
        try:
            settings = transformers.AutoConfig.for_model(
                family.split("+")[0], **{k: v for k, v in fields.items() if v != DROP})
            outcome, detail = run(settings, (0, 2, 4))
            if outcome == "ok":
                outcome, detail = run(settings, (0, 0, 0))
        except Exception as error:  # the config itself, or a Timeout outside run
            outcome, detail = "no reference", f"{type(error).__name__}: {error}"[:300]
        finally:
            signal.alarm(0)
        bad += outcome == "DIFFERENT" or outcome.startswith("CRASH")
        print(f"{family:28} {outcome:18} {time.perf_counter() - start:5.1f} s  {detail.splitlines()[0] if detail else ''}",
              flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
