"""loopwire's benchmark suite (not collected by pytest). Run ``python -m tests.bench --help``."""
