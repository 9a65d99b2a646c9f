"""``python -m worker.cli``: the ``loopwire`` command."""

import sys

from worker.cli.main import main

sys.exit(main())
