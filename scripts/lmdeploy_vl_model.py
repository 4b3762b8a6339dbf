"""A tiny random-weight Qwen2-VL (M-RoPE) that lmdeploy 0.18's pipeline() loads offline, and requests for it.

    from lmdeploy_vl_model import save_vl_model, vl_requests
    save_vl_model(path)                 # config, bf16 weights, word-level tokenizer, processor, chat template
    prompts = vl_requests(8)            # openai-style messages; every third one carries a generated PIL image

lmdeploy's pytorch engine reads ``model_type`` qwen2_vl with a ``text_config`` as ``use_mrope=True``: every
sequence, text-only too, carries (3, tokens) M-RoPE positions that decode steps copy into the graph's
``mrope_position_ids`` buffer; after an image the three rows differ from ``position_ids``.
"""

from __future__ import annotations

import json
import os
import random

WORDS = 1000
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
           "<|image_pad|>", "<|video_pad|>")
# ChatML without a default system prompt; content is a string (lmdeploy) or a list of items (transformers).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'text' %}{{ item['text'] }}{% elif item['type'] in ['image', 'image_url'] %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PATCH, MERGE = 14, 2
FACTOR = PATCH * MERGE  # image sides are resized to multiples of 28 pixels
IMAGE_SIZES = ((56, 56), (112, 84), (84, 140))  # (width, height): 4, 12 and 15 image tokens


def save_vl_model(path: str, layers: int = 4, hidden: int = 512) -> None:
    """A random Qwen2-VL (bf16, 8 heads / 2 kv heads, a 2-block vision tower) with a word-level tokenizer;
    ``hidden`` a multiple of 64 (M-RoPE sections)."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(WORDS)} | {"<unk>": WORDS, "system": WORDS + 1, "user": WORDS + 2,
                                                   "assistant": WORDS + 3}
    ids = {tok: len(vocab) + i for i, tok in enumerate(SPECIAL)}
    tok = Tokenizer(models.WordLevel(vocab=vocab | ids, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=list(SPECIAL), chat_template=CHAT_TEMPLATE)
    half = hidden // 8 // 2  # M-RoPE sections (t, h, w) add up to half the head size, as Qwen2-VL's 16/24/24 of 64
    text = dict(vocab_size=len(vocab) + len(SPECIAL), hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192,
                eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"], bos_token_id=None,
                rope_parameters=dict(rope_type="default", rope_theta=1e6,
                                     mrope_section=[half // 4, half * 3 // 8, half * 3 // 8]))
    vision = dict(depth=2, embed_dim=256, num_heads=4, mlp_ratio=2, hidden_size=hidden, patch_size=PATCH,
                  spatial_merge_size=MERGE, temporal_patch_size=2)
    config = transformers.Qwen2VLConfig(
        text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Qwen2VLForConditionalGeneration(config)
    # Wider logits than the default initialisation gives, so that greedy tokens do not hang on near-ties.
    model.lm_head.weight.data.mul_(5)
    model.to(torch.bfloat16).save_pretrained(path)  # checkpoint keys: model.layers.*, visual.*, lm_head.*
    # lmdeploy's Qwen3VLModelConfigBuilder takes the dtype from text_config.
    with open(os.path.join(path, "config.json")) as f:
        saved = json.load(f)
    saved["text_config"]["dtype"] = "bfloat16"
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(saved, f, indent=2)
    tokenizer.save_pretrained(path)
    # lmdeploy's Qwen2VLModel.preprocess calls processor.image_processor alone; pixels bounded to 4..16 image
    # tokens. AutoProcessor builds Qwen2VLVideoProcessor too, which needs torchvision (the GPU image has it).
    image_processor = dict(image_processor_type="Qwen2VLImageProcessor", processor_class="Qwen2VLProcessor",
                           size={"shortest_edge": FACTOR * FACTOR, "longest_edge": 16 * FACTOR * FACTOR},
                           patch_size=PATCH, merge_size=MERGE, temporal_patch_size=2, do_resize=True,
                           do_rescale=True, rescale_factor=1 / 255, do_normalize=True, do_convert_rgb=True,
                           image_mean=[0.48145466, 0.4578275, 0.40821073],
                           image_std=[0.26862954, 0.26130258, 0.27577711])
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump(image_processor, f, indent=2)


def image(index: int):
    """A deterministic RGB test image (PIL), one of IMAGE_SIZES."""
    from PIL import Image

    width, height = IMAGE_SIZES[index % len(IMAGE_SIZES)]
    rng = random.Random(index)
    return Image.frombytes("RGB", (width, height), bytes(rng.randrange(256) for _ in range(width * height * 3)))


def vl_requests(count: int, seed: int = 0, images: bool = True) -> list[list[dict]]:
    """Prompts of 1..300 words as openai messages (the one form pipeline() takes mixed), every third one
    (i % 3 == 1) with a generated image before its words."""
    rng = random.Random(seed)
    prompts: list[list[dict]] = []
    for i in range(count):
        words = " ".join(f"t{rng.randrange(WORDS)}" for _ in range(rng.randint(1, 300)))
        content: str | list[dict] = words
        if images and i % 3 == 1:
            content = [{"type": "image_data", "image_data": {"data": image(i // 3)}}, {"type": "text", "text": words}]
        prompts.append([{"role": "user", "content": content}])
    return prompts
