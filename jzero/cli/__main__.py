"""``python -m jzero.cli COMMAND ...``: the ``jzero`` command."""

import sys

from jzero.cli import main

sys.exit(main())
