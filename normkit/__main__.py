"""``python -m normkit``: the same as the ``normkit`` command."""

import sys

from normkit.cli import main

sys.exit(main())
