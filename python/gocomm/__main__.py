"""`python -m gocomm ...`: the `gocomm` command (gocomm/_cli.py)."""

import sys

from ._cli import main

sys.exit(main())
