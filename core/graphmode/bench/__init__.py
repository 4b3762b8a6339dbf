"""``graphmode bench``: graph mode against eager, a hand-written CUDA graph
and ``torch.compile(mode="reduce-overhead")``, with capture cost, host cost
and padding waste. See docs/performance.md."""
