"""``python -m musecore``: the same command line as the ``musecore`` script."""

import sys

from musecore.cli import main

sys.exit(main())
