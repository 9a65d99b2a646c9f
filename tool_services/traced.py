"""A tool service's span for each call it takes, when tracing is on (``OTEL_*``): a child of
the worker's ``execute_tool`` span, whose context the call's AMQP headers carry
(``traceparent``). Like gRPC's, the server's span has the client's name: ``execute_tool
<tool>``, kind ``SERVER``. What the tool does runs inside it."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from aio_pika.abc import AbstractIncomingMessage
from opentelemetry.trace import SpanKind, Tracer

from contracts.runtime.tracing import extract

Handler = Callable[[AbstractIncomingMessage], Coroutine[Any, Any, None]]


def traced(tracer: Tracer, handle: Handler, service: str) -> Handler:
    async def handle_traced(message: AbstractIncomingMessage) -> None:
        tool = message.routing_key or ""
        with tracer.start_as_current_span(
            f"execute_tool {tool}",
            context=extract(message.headers),
            kind=SpanKind.SERVER,
            attributes={
                "gen_ai.operation.name": "execute_tool",
                "gen_ai.tool.name": tool,
                "gen_ai.tool.call.id": message.correlation_id or "",
                "messaging.system": "rabbitmq",
                "messaging.operation.type": "process",
                "loopwire.tool_service": service,
            },
        ):
            await handle(message)

    return handle_traced
