"""``python -m worker``: run a worker process."""

import sys

from worker.app import main

sys.exit(main())
