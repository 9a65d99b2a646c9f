"""The worker's event sink as it counts: every event published (and every one that could not
be) counted by type in the worker's metrics (``worker.runtime.metrics``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from contracts.events import Event
from worker.loop.ports import EventSink

if TYPE_CHECKING:
    from worker.runtime.metrics import WorkerMetrics


class CountingSink:
    """``EventSink`` that counts what it publishes (and fails to publish) through ``inner``."""

    def __init__(self, inner: EventSink, metrics: WorkerMetrics) -> None:
        self.inner = inner
        self.metrics = metrics

    async def emit(self, event: Event) -> None:
        try:
            await self.inner.emit(event)
        except Exception:
            self.metrics.child(self.metrics.event_errors, event.type).inc()
            raise
        self.metrics.child(self.metrics.events, event.type).inc()
