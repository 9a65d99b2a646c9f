"""The OpenTelemetry SDK's part of tracing (``contracts.runtime.tracing`` says when it is on):
the tracer provider from ``OTEL_*``, and the ids a span begun elsewhere is given."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

from contracts.runtime.tracing import configured

_chosen: ContextVar[tuple[int | None, int | None]] = ContextVar(
    "loopwire_chosen_ids", default=(None, None)
)


class ChosenIds(RandomIdGenerator):
    """Random ids, except inside ``chosen_ids``: the ids saved for a span begun elsewhere."""

    def generate_span_id(self) -> int:
        span_id = _chosen.get()[1]
        return span_id if span_id is not None else super().generate_span_id()

    def generate_trace_id(self) -> int:
        trace_id = _chosen.get()[0]
        return trace_id if trace_id is not None else super().generate_trace_id()


@contextlib.contextmanager
def chosen_ids(trace_id: int | None, span_id: int) -> Iterator[None]:
    """The next span made here takes these ids (the trace id only when it is a root)."""
    token = _chosen.set((trace_id, span_id))
    try:
        yield
    finally:
        _chosen.reset(token)


def start_tracing(
    service_name: str, environ: Mapping[str, str] | None = None
) -> TracerProvider | None:
    """The tracer provider the environment configures (``None``: tracing is off). The caller
    shuts it down at exit, which exports what is still batched."""
    env = os.environ if environ is None else environ
    if not configured(env):
        return None
    attributes: dict[str, Any] = {}
    if not env.get("OTEL_SERVICE_NAME"):
        attributes["service.name"] = service_name
    provider = TracerProvider(resource=Resource.create(attributes), id_generator=ChosenIds())
    provider.add_span_processor(BatchSpanProcessor(_exporter(env)))
    return provider


def _exporter(env: Mapping[str, str]) -> SpanExporter:
    if env.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "console":
        return ConsoleSpanExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()
