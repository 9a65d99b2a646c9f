"""``python -m tests.bench``: run the benchmark suite (see ``tests/bench/run.py``)."""

import sys

from tests.bench.run import main

sys.exit(main())
