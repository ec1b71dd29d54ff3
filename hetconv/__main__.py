"""``python -m hetconv``: the same as the ``hetconv`` command."""

import sys

from hetconv.cli import main

sys.exit(main())
