"""Graph families: the ways a runner runs steps as captured device graphs,
below the runner (they import nothing of ``graphmode.runner``).

``family.py`` holds the protocol every family implements and what the runner
shares with them; ``modes.py`` the execute modes, each an ordered tuple of
families; ``full.py`` the full decode graphs; ``piecewise/`` the piecewise
token graphs. The rest serves every family: ``common.py`` (the inert step,
capture advice), ``outputs.py`` (the output cut and shared result buffers),
``host_fields.py`` (host copies of the step's lengths), ``compile.py`` (the
compiled forward), ``sleep.py`` (sleep and wake), ``stats.py`` (statistics).
"""
