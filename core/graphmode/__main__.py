"""``python -m graphmode``: the ``graphmode`` command."""

import sys

from graphmode.cli import main

sys.exit(main())
