"""The bounds of the worker's metrics (``worker.runtime.metrics``): histogram buckets, the
store operations timed, and which metrics carry a ``tenant`` label when asked to."""

from __future__ import annotations

from typing import Final

OPERATION_CHAT: Final = "chat"
"""``gen_ai.operation.name`` of a chat-completions call."""

# OpenTelemetry GenAI semantic conventions: explicit bucket boundaries advised for these two.
MODEL_DURATION_BUCKETS: Final = (
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
)  # fmt: skip
TOKEN_BUCKETS: Final = (
    1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864,
)  # fmt: skip
TURN_BUCKETS: Final = (0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1800)
STEP_BUCKETS: Final = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300)
STEPS_PER_TURN_BUCKETS: Final = (1, 2, 3, 4, 5, 7, 10, 15, 20, 30, 50)
STORE_BUCKETS: Final = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5,
)  # fmt: skip
STORE_OPERATIONS: Final = (
    "accept", "lease", "renew", "release", "save", "load_messages", "read",
)  # fmt: skip


TENANT_LABELLED: Final = (
    "turns_started", "turns_finished", "turn_duration", "turn_steps", "step_duration",
    "model_tokens", "tool_duration", "hints", "caps", "budgets", "children", "cancellations",
    "throttles", "dead_lettered", "dropped", "session_reads",
)  # fmt: skip
"""The metrics (``WorkerMetrics`` attributes) that carry a ``tenant`` label when asked to."""
