"""``python -m jzero COMMAND ...``: the same as the ``jzero`` command (e.g. under
``jzero launch --module jzero train ...``)."""

import sys

from jzero.cli import main

sys.exit(main())
