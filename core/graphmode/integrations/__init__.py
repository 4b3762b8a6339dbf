"""Adapters that put other libraries' models on graphmode's model contract.

- :mod:`graphmode.integrations.huggingface`: decoder-only Hugging Face
  ``transformers`` models on a paged KV cache (extra ``[hf]``).
- :mod:`graphmode.integrations.lmdeploy`: the other way round, an engine on
  graphmode: lmdeploy's PyTorch engine builds its graph runners through
  graphmode (``enable()``), its models and their buffers as lmdeploy ships them.
"""
