"""The benchmark suite is run with ``python -m tests.bench``, never collected by pytest."""

collect_ignore_glob = ["*.py"]
