"""graphmode's API in one file that runs as written, on the CPU (README.md,
"The API in one example", shows the code below this docstring word for word;
tests/test_quickstart.py runs it and holds the two together).

    python examples/quickstart.py
"""

import graphmode
from graphmode.model import ModelConfig, build_reference_model
from graphmode.model.engine import ReferenceEngine

config = ModelConfig.tiny()                          # a 2-layer Llama-style model, random weights
model = build_reference_model(config, device="cpu")  # on "cpu", graphs run on the CPU graph emulator
kv_cache = model.make_kv_cache(num_cache_blocks=64, block_size=16)  # 64 blocks, shared by every sequence
runner = graphmode.build_graph_runner(model, max_batches=8, max_blocks_per_seq=4, block_size=16)  # vendor detected
runner.warmup(kv_cache)                              # optional: capture every bucket now, largest first

# The engine's part: blocks of the cache per sequence, and each step's AttnMetadata (block tables, slots, lengths).
engine = ReferenceEngine(num_cache_blocks=64, block_size=16, device="cpu", vocab_size=config.vocab_size)
seqs = [engine.add() for _ in range(3)]
step = engine.prefill(seqs, [5, 9, 3])               # three prompts (random tokens): runs eagerly
logits = runner(input_ids=step.input_ids, position_ids=step.position_ids,
                past_key_values=kv_cache, attn_metadata=step.attn_metadata)
meta = step.attn_metadata
tokens = logits[0, meta.q_start_loc + meta.q_seqlens - 1].argmax(-1)  # each prompt's next token (greedy)
generated = [tokens.tolist()]
for _ in range(8):                                   # decode: one token per sequence, graph replays (bucket 3)
    step = engine.decode(seqs)
    logits = runner(input_ids=tokens[None], position_ids=step.position_ids,
                    past_key_values=kv_cache, attn_metadata=step.attn_metadata)
    tokens = logits[0].argmax(-1)
    generated.append(tokens.tolist())
print("tokens per sequence:", [list(row) for row in zip(*generated)])
print(runner.stats.summary())                        # captures, replays, eager steps and why, padding
