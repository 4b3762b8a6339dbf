"""Debug mode's checks of an lmdeploy decode step, before its graph replays.

They read the step's device values on the host (one synchronisation per
step), which is why they run in debug mode only (``enable(debug=True)`` or
``GRAPHMODE_DEBUG=1``). Each names the row, the value, the limit and the fix.
"""

from __future__ import annotations

from typing import Any

from graphmode.errors import InputError

__all__ = ["check_decode_step"]


def check_decode_step(kwargs: dict[str, Any], bucket: int, q_len: int, num_blocks: int, block_size: int,
                      reserved_blocks: int = 1) -> None:
    """Refuse a decode step whose graph would compute something else than
    its eager step, or write KV where no live row of it owns: ``q_len``
    tokens per sequence (the graph replays that many for every row), a
    batch within the bucket, lengths the block table addresses, and block
    ids inside the cache and outside lmdeploy's reserved padding blocks
    (``num_reserved_gpu_blocks``, which the padding rows of every graph
    write into)."""
    attn = kwargs["attn_metadata"]
    batch = attn.q_seqlens.size(0)
    num_tokens = kwargs["input_ids"].size(1)
    if batch > bucket:
        raise InputError(f"decode step of {batch} sequences in the graph of bucket {bucket}: padding would drop "
                         "sequences; this is a graphmode bug, report it")
    if num_tokens != batch * q_len:
        raise InputError(f"decode step of {num_tokens} tokens for {batch} sequences: a decode graph takes the same "
                         f"number of tokens ({q_len}) from every sequence")
    q_seqlens = attn.q_seqlens.tolist()
    kv_seqlens = attn.kv_seqlens.tolist()
    table = attn.block_offsets[:batch].tolist()
    width = attn.block_offsets.size(1)
    for row in range(batch):
        if q_seqlens[row] != q_len:
            raise InputError(f"decode step row {row}: q_seqlens={q_seqlens[row]}, but the graph replays {q_len} "
                             f"token(s) per sequence (input_ids holds {num_tokens} for {batch}); schedule rows of "
                             "different query lengths in separate steps")
        kv = kv_seqlens[row]
        if not q_len <= kv <= width * block_size:
            raise InputError(f"decode step row {row}: kv_seqlens={kv}, outside {q_len}..{width * block_size} (its "
                             f"{width} block-table columns of {block_size} tokens); the engine's lengths or block "
                             "table are wrong")
        used = table[row][: (kv + block_size - 1) // block_size]
        bad = [block for block in used if not reserved_blocks <= block < num_blocks]
        if bad:
            raise InputError(f"decode step row {row}: block ids {bad} in its first {len(used)} columns are outside "
                             f"{reserved_blocks}..{num_blocks - 1} (blocks below {reserved_blocks} are the padding "
                             "rows'); the engine handed the row a block it does not own")
