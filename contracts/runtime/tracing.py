"""OpenTelemetry tracing for every loopwire process, set up from the standard ``OTEL_*``
environment variables, and W3C trace context on AMQP headers.

Tracing is on when the environment asks for an exporter: ``OTEL_EXPORTER_OTLP_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (OTLP over HTTP/protobuf), or ``OTEL_TRACES_EXPORTER``
(``otlp``, ``console``); ``OTEL_TRACES_EXPORTER=none`` or ``OTEL_SDK_DISABLED=true`` turn it
off. Everything else (``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``,
``OTEL_TRACES_SAMPLER``/``_ARG``, the exporter's headers, timeouts and batching) is read by the
SDK itself. Off, no provider is built and the processes make no span at all.

This module needs only the OpenTelemetry API (the client uses it to pass its caller's span
on); the SDK's part is ``contracts.runtime.tracer_setup``.

A turn's span is started by one worker and ended by another, so its ids are chosen when the
turn starts, saved in its state, and given back to the SDK when the span is finally made
(``ChosenIds``, the SDK's id-generator extension point).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, MutableMapping
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")
_PROPAGATOR = TraceContextTextMapPropagator()


def configured(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the environment asks for traces to be exported."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none":
        return False
    return bool(
        exporter
        or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def inject(headers: MutableMapping[str, Any], context: Context | None = None) -> None:
    """Add the current (or ``context``'s) span as ``traceparent``/``tracestate``."""
    _PROPAGATOR.inject(headers, context=context)


def extract(headers: Mapping[str, Any] | None) -> Context | None:
    """The remote span named by AMQP headers (``None``: no valid ``traceparent``)."""
    parent = header_traceparent(headers)
    if parent is None:
        return None
    carrier = {TRACEPARENT: parent}
    state = _text((headers or {}).get(TRACESTATE))
    if state:
        carrier[TRACESTATE] = state
    return _PROPAGATOR.extract(carrier)


def header_traceparent(headers: Mapping[str, Any] | None) -> str | None:
    """A valid ``traceparent`` header's value (an invalid one is ignored, as W3C says)."""
    value = _text((headers or {}).get(TRACEPARENT))
    if value is None or not _TRACEPARENT.match(value) or value.startswith("ff"):
        return None
    return value


def header_tracestate(headers: Mapping[str, Any] | None) -> str | None:
    value = _text((headers or {}).get(TRACESTATE))
    return value[:512] if value else None


def context_of(traceparent: str | None, tracestate: str | None = None) -> Context | None:
    """The remote span a saved ``traceparent`` names."""
    if traceparent is None:
        return None
    carrier = {TRACEPARENT: traceparent}
    if tracestate:
        carrier[TRACESTATE] = tracestate
    context = _PROPAGATOR.extract(carrier)
    return context if trace.get_current_span(context).get_span_context().is_valid else None


def _text(value: Any) -> str | None:
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    return value.strip() if isinstance(value, str) else None
