"""Adapters that put other libraries' models on graphmode's model contract.

- :mod:`graphmode.integrations.huggingface`: decoder-only Hugging Face
  ``transformers`` models on a paged KV cache (extra ``[hf]``).
"""
