"""The runner's checks, one concept per module, below the runner and its
graph families (they import neither):

- always-on step checks, from host facts only (no synchronisation):
  ``validate`` (a step's shapes, dtypes, placement and maxima; the model at
  construction), ``step_sizes`` (batch and token counts), ``step_checks``
  (the per-layout memo of those checks), ``signature`` (the model's
  forward signature), ``host_lengths`` (the step's lengths from host values);
- debug-mode checks, which read device values or watch the device:
  ``debug`` (``debug=True``), ``host_reads`` (host reads during a replay);
- cache checks: ``cache_layout`` (a cache's geometry), ``cache_checks`` (the
  cache meets the runner, the captured cache tensors and their addresses);
- model-state checks: ``model_state`` (module attributes a capture changes,
  tensors an eager step rebinds), ``weight_memory`` (parameter addresses).
"""
