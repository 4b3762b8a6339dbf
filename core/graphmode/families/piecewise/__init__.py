"""Piecewise graphs: the forward split at its attention calls (and at
:func:`host_break` markers) into segments captured per token bucket, with the
break points run eagerly between them at every replay.

Execute modes "piecewise" (every step) and "full_and_piecewise" (full decode
graphs for uniform decode steps, piecewise for the rest); see
docs/architecture.md, "Piecewise graphs". The runner imports
``graphmode.families.piecewise.graphs`` when a runner is built in one of these modes.
"""

from graphmode.families.piecewise.breaks import host_break
from graphmode.token_buckets import default_token_sizes, token_bucket

__all__ = ["default_token_sizes", "host_break", "token_bucket"]
