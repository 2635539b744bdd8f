"""``python -m meshtorch`` is the ``meshtorch`` command."""

import sys

from meshtorch.cli import main

sys.exit(main())
