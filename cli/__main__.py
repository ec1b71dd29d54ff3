"""``python -m hetconv.cli``: the same as the ``hetconv`` command."""

import sys

from hetconv.cli.main import main

sys.exit(main())
