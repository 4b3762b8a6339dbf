"""Which transformers families the Hugging Face adapter runs, and the
refusals at load of those it cannot: every family it claims decodes the
greedy tokens of ``generate(do_sample=False)`` through graph replays on the
CPU emulator (tiny random configs: 2 layers, hidden 64); every family it
cannot run is refused by ``load_model`` with a ConfigError naming the
family, the reason and the fix, and a sliding window shorter than the
runner's block table is refused when the runner is built. docs/engines.md's
table lists the same families."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import graphmode  # noqa: E402
from graphmode.errors import ConfigError  # noqa: E402
from graphmode.integrations.huggingface import HuggingFaceModel, load_model  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import serve_hf  # noqa: E402

VERSION = tuple(int(part) for part in transformers.__version__.split(".")[:2])
V5 = VERSION >= (5, 0)
#: Before 5.21, longrope picks its factors with `if seq_len > original_max_position_embeddings`
#: on a device tensor (a host read), graph-safe since (`torch.where`).
LONGROPE_READS_HOST = VERSION < (5, 21)
BLOCK_SIZE, WIDTH, MAX_BATCH = 4, 8, 2
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=128,
            max_position_embeddings=256)
GQA = dict(TINY, num_key_value_heads=2)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
MIXED = ["sliding_attention", "full_attention"]  # a sliding layer, a full one (window = the table's reach)

#: Families that run, with the fields of their tiny config.
RUNS = {
    "gemma": dict(GQA, head_dim=16),
    # Attention soft-capping off; the final soft-capping, on the logits, stays.
    "gemma2": dict(GQA, head_dim=16, attn_logit_softcapping=None, final_logit_softcapping=30.0),
    # Sliding layers whose window equals the table's reach (8 blocks x 4).
    "gemma3_text": dict(GQA, head_dim=16, sliding_window=32),
    "phi": dict(GQA),
    "phi3": dict(GQA, **TOKENS),
    "gpt_neox": dict(TINY),
    "gpt2": dict(TINY, n_inner=128),
    "gpt_bigcode": dict(TINY, n_inner=128),
    "gptj": dict(TINY, rotary_dim=8, n_inner=128),
    "codegen": dict(TINY, rotary_dim=8, n_inner=128, n_ctx=256, **TOKENS),
    "opt": dict(TINY, ffn_dim=128, word_embed_proj_dim=64),
    "olmo": dict(GQA),
    "olmo2": dict(GQA),
    "granite": dict(GQA),
    "cohere": dict(GQA, **TOKENS),
    "starcoder2": dict(GQA),
    "persimmon": dict(TINY),
    "mixtral": dict(GQA, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(GQA, **MOE, num_experts=4, shared_expert_intermediate_size=32),
    "qwen3_moe": dict(GQA, **MOE, num_experts=4, head_dim=16),
    # Added by the family sweep of 2026-11-26 (transformers 5.24.0); "family+what" varies one feature.
    "cohere2": dict(GQA, head_dim=16, sliding_window=32, layer_types=MIXED, **TOKENS),  # its full layers: NoPE
    "exaone4": dict(GQA, head_dim=16, sliding_window=32, layer_types=MIXED, **TOKENS),
    "smollm3": dict(GQA, head_dim=16, no_rope_layers=[1, 0], **TOKENS),  # layer 1 without RoPE
    "ministral": dict(GQA, head_dim=16, sliding_window=32, layer_types=MIXED, **TOKENS),
    "glm4": dict(GQA, head_dim=16, **TOKENS),  # partial, interleaved rotary
    "ernie4_5": dict(GQA, head_dim=16, **TOKENS),
    "helium": dict(GQA, head_dim=16, **TOKENS),
    "seed_oss": dict(GQA, head_dim=16, **TOKENS),
    "hunyuan_v1_dense": dict(GQA, head_dim=16, **TOKENS),
    "bitnet": dict(GQA, head_dim=16, **TOKENS),
    "olmoe": dict(GQA, **MOE, num_experts=4, head_dim=16, **TOKENS),
    "granitemoe": dict(GQA, **MOE, num_local_experts=4, head_dim=16, **TOKENS),
    "phimoe": dict(GQA, **MOE, num_local_experts=4, head_dim=16, **TOKENS),
    "llama+rope-linear": dict(GQA, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "llama+rope-yarn": dict(GQA, rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    "llama+rope-llama3": dict(GQA, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "llama+bias-tied": dict(GQA, attention_bias=True, mlp_bias=True, tie_word_embeddings=True),
    # Long factors past 32 tokens: never within the table's reach (8 blocks x 4).
    "phi3+longrope": dict(GQA, **TOKENS, original_max_position_embeddings=32, rope_scaling=dict(
        rope_type="longrope", short_factor=[1.0] * 8, long_factor=[4.0] * 8, original_max_position_embeddings=32)),
    "qwen2+window": dict(GQA, use_sliding_window=True, sliding_window=32, max_window_layers=1),
    # Its forward assigns its position table to itself at every call (a no-op .to()): taken as a rebind,
    # every graph step after an eager one was refused (an HF-families hunt, 2026-12-04).
    "ctrl": dict(TINY, **TOKENS),
}
#: Checked with transformers 5.24.0 only (skipped on 4.x): the sweep's additions.
V5_ONLY = set(list(RUNS)[list(RUNS).index("cohere2"):])
#: What older transformers do differently (CI runs 4.56.0 on torch 2.5, the
#: GPU machine 5.17.0): families refused at load before the release named,
#: whose attention did not reach the attention interface until then (GPT-J's
#: and CodeGen's until 5.24), and families whose MoE routing calls nonzero in 4.x
#: (graph modes refused when the runner is built).
ROUTED_FROM = {"gptj": (5, 24), "codegen": (5, 24), "gpt_bigcode": (5, 0), "qwen2_moe": (5, 0), "gpt2": (5, 0)}
NONZERO_BEFORE_V5 = {"mixtral", "qwen3_moe"}


def config(family: str, **fields):
    return transformers.AutoConfig.for_model(family, **fields)



def build(model, width=WIDTH, **options):
    """The runner of these tests: the small cache, ``width`` blocks per sequence."""
    return graphmode.build_graph_runner(model, max_batches=MAX_BATCH, max_blocks_per_seq=width, block_size=BLOCK_SIZE,
                                        **options)

def requests() -> list[serve_hf.Request]:
    # Two prompts of different lengths prefilled in one step, a third later.
    generator = torch.Generator().manual_seed(1)
    return [serve_hf.Request(torch.randint(3, 128, (n,), generator=generator).tolist(), new, arrival=arrival)
            for n, new, arrival in [(5, 6, 0), (9, 4, 0), (3, 7, 4)]]


@pytest.mark.parametrize("family", sorted(RUNS))
def test_family_decodes_hf_greedy_tokens(family):
    key, fields, family = family, RUNS[family], family.split("+")[0]
    if not hasattr(transformers, "AutoConfig") or family not in transformers.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {family}")
    if not V5 and key in V5_ONLY:
        pytest.skip("checked with transformers 5.24.0 only")
    settings = config(family, **fields)
    if not V5 and family in NONZERO_BEFORE_V5:
        model = load_model(settings)
        with pytest.raises(ConfigError, match=rf"'{family}' cannot run in execute_mode='graph' \(transformers 4\.\S+\): "
                           r"its forward calls aten.nonzero.default at \S+modeling_\w+\.py:\d+ in forward, whose "
                           r"output size depends on tensor values.*execute_mode='eager'"):
            build(model)
        return
    if ROUTED_FROM.get(family, (0, 0)) > VERSION:  # refused in this version
        with pytest.raises(ConfigError, match=f"'{family}' is not supported"):
            load_model(settings)
        return
    if key == "phi3+longrope" and LONGROPE_READS_HOST:
        with pytest.raises(ConfigError, match=r"calls Tensor.__bool__\(\) at \S+modeling_rope_utils.py:\d+ in "
                           r"longrope_frequency_update, which reads device memory on the host"):
            build(load_model(settings))
        return
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(settings).eval()
    expected = []
    for item in requests():
        prompt = torch.tensor([item.prompt])
        out = reference.generate(prompt, max_new_tokens=item.max_new_tokens, do_sample=False,
                                 attention_mask=torch.ones_like(prompt), pad_token_id=0)
        expected.append(out[0, prompt.shape[1]:].tolist())
    eos = reference.generation_config.eos_token_id  # generate stops there; so does serve
    eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    model = load_model(settings)
    model.hf_model.load_state_dict(reference.state_dict())
    cache_blocks = MAX_BATCH * WIDTH + 1
    kv_cache = model.make_kv_cache(cache_blocks, BLOCK_SIZE)
    runner = build(model)
    batch = serve_hf.PagedBatch(cache_blocks, BLOCK_SIZE, WIDTH, torch.device("cpu"))
    served = requests()
    steps = serve_hf.serve(runner, kv_cache, batch, served, max_batch=MAX_BATCH, eos=eos)
    assert [r.output for r in served] == expected
    assert runner.stats.captures + runner.stats.replays == steps["decode"] >= 1


#: Families refused at load: (config fields, what the message says).
REFUSED = {
    "falcon": (TINY, r"'falcon' is not supported: .*FalconForCausalLM declares no support .*ATTENTION_CLASSES"),
    "stablelm": (GQA, r"'stablelm' is not supported: .*StableLmForCausalLM declares no support"),
    "gpt_oss": (dict(GQA, head_dim=16, num_local_experts=4, num_experts_per_tok=2),
                r"'gpt_oss' is not supported: model.layers.0.self_attn has attention sinks "
                r"\(GptOssAttention.sinks, shape \(4,\)"),
    "gemma2": (dict(GQA, head_dim=16), r"'gemma2' with config.attn_logit_softcapping=50.0 is not supported"),
    "deepseek_v3": (dict(GQA, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
                         v_head_dim=16, first_k_dense_replace=2),
                    r"'deepseek_v3' is not supported: .*keys of shape \(1, 4, 1, 24\) and values of shape "
                    r"\(1, 4, 1, 16\)"),
    "llama4_text": (GQA, r"'llama4_text' with layers of type \['chunked_attention'\]"),
    # Two recurrent layers, then attention.
    "recurrent_gemma": (dict(TINY, num_hidden_layers=3), r"'recurrent_gemma' with layers of type \['linear_attention'\]"),
    "bert": (TINY, r"'bert' is not supported: .*attends bidirectionally .*set config.is_decoder=True"),
    # Differential attention: two attention calls per layer, with different values.
    "diffllama": (GQA, r"'diffllama' is not supported: model.layers.0.self_attn \(DiffLlamaAttention\) calls "
                  r"transformers' attention interface 2 times per forward for layer_idx 0 .*second call would "
                  r"overwrite"),
    # Composite (multimodal) configs: no num_hidden_layers of their own.
    "fuyu": (TINY, r"'fuyu' is not supported: its config is composite \(text_config: its decoder's settings are a "
             r"sub-config's\).*pass its config.text_config"),
    # Even with the decoder's fields at the top level.
    "gemma3": (TINY, r"'gemma3' is not supported: its config is composite \(text_config, vision_config"),
    # A recurrent section run twice per forward: HF keeps a KV cache per pass.
    "dory": (dict(GQA, head_dim=16, **TOKENS), r"'dory' is not supported: model.layers.0.self_attn \(DoryAttention\) "
             r"calls transformers' attention interface 2 times per forward for layer_idx 0 .*loops over its layers"),
    # Its own mask, a bias from the values (exp(A * softplus(dt_proj(v))) per key): the paged kernels ignore
    # masks, so a trained Doge (A != 0) gave other logits. Random weights (A = 0: a constant bias) hid it.
    "doge": (dict(GQA, head_dim=16, **TOKENS), r"'doge' is not supported: model.layers.0.self_attn \(DogeAttention\) "
             r"passes attention a bias as its mask \(a tensor of shape \(1, 4, 1, 1\); Doge's.*ignore"),
}
#: Before 5.23 RecurrentGemma's config has no layer_types: its probe finds the recurrent layers.
if VERSION < (5, 23):
    REFUSED["recurrent_gemma"] = (REFUSED["recurrent_gemma"][0], r"'recurrent_gemma' is not supported: .*layer_idx "
                                  r"\[2\].*layers \[0, 1\] never called it \(recurrent")
#: From 5.25 Falcon calls the attention interface, but its decoder layers pass no keyword arguments on to it.
if VERSION >= (5, 25):
    REFUSED["falcon"] = (REFUSED["falcon"][0], r"'falcon' is not supported: .*FalconForCausalLM declares no support "
                         r".*does not declare that its layers pass the model's keyword arguments on")
#: What transformers 4.x gives instead: no attention backend on these classes.
if not V5:
    for name in ("bert", "recurrent_gemma", "diffllama"):
        REFUSED[name] = (REFUSED[name][0], rf"'{name}' is not supported: .* declares no support for registered")


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_family_the_adapter_cannot_run_is_refused_at_load(family):
    if family not in transformers.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {family}")
    fields, message = REFUSED[family]
    with pytest.raises(ConfigError, match=message) as refused:
        load_model(config(family, **fields))
    assert "tensor(" not in str(refused.value)  # names and shapes, never values
    assert "docs/engines.md" in str(refused.value)


@pytest.mark.parametrize("family, fields", [
    ("mistral", dict(GQA, sliding_window=16)),  # every layer, passed to attention
    ("gemma3_text", dict(GQA, head_dim=16, sliding_window=16)),  # sliding layers of config.layer_types
])
@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_sliding_window_shorter_than_the_table_is_refused_when_the_runner_is_built(family, fields, mode):
    model = load_model(config(family, **fields))
    with pytest.raises(ConfigError, match=r"has a sliding window of 16 tokens \(config.sliding_window\), but the "
                       r"block table can address 32 tokens \(max_blocks_per_seq 8 x block_size 4\).* Raise the window, "
                       r"lower the table width \(max_blocks_per_seq \* block_size <= 16\), or use a model without"):
        build(model, execute_mode=mode)
    # A table within the window is served.
    build(model, width=4, execute_mode=mode)


@pytest.mark.parametrize("mode", ["graph", "piecewise", "full_and_piecewise"])
def test_a_forward_no_graph_can_capture_is_refused_when_the_runner_is_built(mode):
    # Any model whose forward sizes a result from tensor values (a router
    # picking tokens with nonzero, say): graph modes are refused before any
    # step, naming the operator and the line; eager mode serves it.
    hf_model = load_model(config("llama", **GQA)).hf_model

    def route(module, args):
        torch.nonzero(args[0][..., 0] > 0)

    hf_model.model.layers[1].mlp.register_forward_pre_hook(route)
    model = HuggingFaceModel(hf_model, graphmode.load_vendor("cuda").attention_ops(None))
    with pytest.raises(ConfigError, match=rf"'llama' cannot run in execute_mode='{mode}' .*: its forward calls "
                       r"aten.nonzero.default at \S+test_huggingface_families.py:\d+ in route, whose output size "
                       r"depends on tensor values, so no device graph can capture it. Build the runner with "
                       r"execute_mode='eager'"):
        build(model, execute_mode=mode)
    build(model, execute_mode="eager")


@pytest.mark.parametrize("family, fields, call, where", [
    # JetMoE sizes its expert batches with .tolist() (transformers 5.24).
    ("jetmoe", dict(GQA, head_dim=16, num_local_experts=4, num_experts_per_tok=2), r"Tensor.tolist\(\)",
     r"modeling_jetmoe.py:\d+ in forward"),
    # Dynamic RoPE compares the step's longest position with its cache length in an if.
    ("llama", dict(GQA, rope_scaling={"rope_type": "dynamic", "factor": 2.0}), r"Tensor.__bool__\(\)",
     r"modeling_rope_utils.py:\d+ in dynamic_frequency_update"),
])
def test_a_forward_that_reads_the_device_on_the_host_is_refused_when_the_runner_is_built(family, fields, call, where):
    # Before: built, then every decode step failed at its capture.
    if family not in transformers.CONFIG_MAPPING or (family == "jetmoe" and not V5):
        pytest.skip(f"checked with transformers 5.24's {family}")
    model = load_model(config(family, **fields))
    with pytest.raises(ConfigError, match=rf"'{family}' cannot run in execute_mode='graph' .*: its forward calls "
                       rf"{call} at \S+{where}, which reads device memory on the host, so no device graph can "
                       r"capture it. Build the runner with execute_mode='eager'"):
        build(model)
    build(model, execute_mode="eager")


# transformers 4.x takes exactly (type, short_factor, long_factor), the original length a config field.
LONGROPE = dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * 8, long_factor=[4.0] * 8,
                original_max_position_embeddings=16) if V5 else \
    dict(type="longrope", short_factor=[1.0] * 8, long_factor=[4.0] * 8)


@pytest.mark.parametrize("family, fields, kind, limit, name", [
    # Phi-3's long-context RoPE takes its long factors once the step's longest position passes 16.
    ("phi3", dict(GQA, **TOKENS, rope_scaling=LONGROPE, original_max_position_embeddings=16), "longrope", 16,
     "original_max_position_embeddings"),
    # Dynamic NTK rescales once it passes max_position_embeddings.
    ("llama", dict(GQA, rope_scaling={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=16),
     "dynamic", 16, "max_position_embeddings"),
])
@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_a_rope_that_depends_on_the_longest_sequence_is_refused_past_its_length(family, fields, kind, limit, name,
                                                                                mode):
    # Before: served, and a decode step batching a sequence past the length
    # with one before it gave the shorter one other logits than generate.
    model = load_model(config(family, **fields))
    if LONGROPE_READS_HOST and kind == "longrope" and mode != "eager":
        # Before 5.21 longrope's frequencies change behind a host read: refused in graph modes at any width.
        with pytest.raises(ConfigError, match="reads device memory on the host"):
            build(model, width=4, execute_mode=mode)
        return
    with pytest.raises(ConfigError, match=rf"'{family}': its RoPE \(rope_type '{kind}'\) changes its frequencies for a "
                       rf"whole step once the step's longest position passes {limit} tokens \(config.{name}\), but the "
                       r"block table can address 32 tokens \(max_blocks_per_seq 8 x block_size 4\).* Lower the table "
                       rf"width \(max_blocks_per_seq \* block_size <= {limit}\)"):
        build(model, execute_mode=mode)
    if mode == "eager" or kind == "longrope":  # dynamic RoPE's host read keeps it out of graphs
        build(model, width=4, execute_mode=mode)
