"""``loopwire turn`` and ``loopwire tail``: publish a turn and wait for it; follow events.

Exit codes of ``turn``: 0 for an answer (``finish_reason: stop``), 4 when the
iteration cap ended the turn (the text printed is the last content, not an
answer), 3 when the turn failed, was cancelled or was rejected, 1 for any
other error (unreachable broker, no answer in time).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator

from pydantic import ValidationError

from contracts.client import LoopwireClient, TurnHandle, TurnRejectedError
from contracts.control import TurnCancel
from contracts.runtime.amqp import AmqpUnreachableError, address
from contracts.runtime.tls import TlsFiles
from contracts.turns import LimitOverrides, TurnResult
from worker.cli.output import print_event, print_result
from worker.errors import CliError

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_TURN_FAILED = 3
EXIT_MAX_ITERATIONS = 4


async def run_turn_command(
    *,
    amqp_url: str,
    tls: TlsFiles | None = None,
    text: str,
    agent: str,
    session: str | None,
    follow: bool,
    as_json: bool,
    timeout: float,
    max_iterations: int | None,
    deadline_s: float | None = None,
    stream: bool = False,
) -> int:
    async with connect(amqp_url, tls) as client:
        limits = LimitOverrides(max_tool_iterations=max_iterations)
        handle = await client.start_turn(
            agent,
            text,
            session_id=session,
            limits=limits,
            timeout_s=deadline_s,
            stream=True if stream else None,
        )
        try:
            if stream and not as_json:
                result = await _streamed(handle, timeout=timeout)
            else:
                result = await _wait(handle, follow=follow, as_json=as_json, timeout=timeout)
        finally:
            await handle.close()
    if not stream or as_json:
        print_result(result, as_json=as_json)
    if result.finish_reason == "max_iterations":
        sys.stderr.write("note: the turn hit its iteration cap; the text above is not an answer\n")
        return EXIT_MAX_ITERATIONS
    if result.finish_reason != "stop":
        reason = result.error.message if result.error else result.finish_reason
        raise CliError(f"turn {result.turn_id} {result.finish_reason}: {reason}", EXIT_TURN_FAILED)
    return EXIT_OK


async def _wait(handle: TurnHandle, *, follow: bool, as_json: bool, timeout: float) -> TurnResult:
    started = time.monotonic()
    progress = asyncio.create_task(
        _show_progress(handle, follow=follow, as_json=as_json, started=started)
    )
    try:
        return await handle.result(timeout)
    except TurnRejectedError as exc:
        raise CliError(f"turn rejected: {exc.reason}", EXIT_TURN_FAILED) from None
    except TimeoutError:
        raise CliError(
            f"no answer within {timeout:g} s; turn {handle.turn_id} may still be queued or running "
            f"(follow it with: loopwire tail '*.*.*.{handle.turn_id}')"
        ) from None
    finally:
        # let the final event print before stopping the printer
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(progress), 0.5)
        progress.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await progress


async def _streamed(handle: TurnHandle, *, timeout: float) -> TurnResult:
    """--stream: the answers' text on stdout as it arrives (a step that starts over begins a
    new line), then the result's text when nothing was streamed (the agent did not stream)."""
    printed = False
    try:
        async with asyncio.timeout(timeout):
            async for piece in handle.stream():
                if isinstance(piece, TurnResult):
                    if not printed:
                        sys.stdout.write(piece.content or "")
                    sys.stdout.write("\n")
                    sys.stdout.flush()
                    return piece
                if piece.restarted and printed:
                    sys.stdout.write("\n")
                sys.stdout.write(piece.text)
                sys.stdout.flush()
                printed = printed or bool(piece.text)
    except TurnRejectedError as exc:
        raise CliError(f"turn rejected: {exc.reason}", EXIT_TURN_FAILED) from None
    except TimeoutError:
        raise CliError(
            f"no answer within {timeout:g} s; turn {handle.turn_id} may still be queued or running"
        ) from None
    raise CliError(f"turn {handle.turn_id}: its events ended without a result")


async def _show_progress(
    handle: TurnHandle, *, follow: bool, as_json: bool, started: float
) -> None:
    """With --follow, every event on stdout; otherwise short progress lines on stderr."""
    async for event in handle.events():
        if follow:
            print_event(event, as_json=as_json)
        elif sys.stderr.isatty():
            elapsed = time.monotonic() - started
            sys.stderr.write(f"\r\033[K… {elapsed:5.1f} s  {event.type}")
            sys.stderr.flush()
    if not follow and sys.stderr.isatty():
        sys.stderr.write("\r\033[K")


async def run_tail_command(
    *,
    amqp_url: str,
    tls: TlsFiles | None = None,
    pattern: str,
    as_json: bool,
    count: int | None,
    tree: str | None = None,
) -> int:
    """Print events as they come: those matching ``pattern``, or (``tree``) those of a turn and
    of its child turns."""
    async with connect(amqp_url, tls) as client:
        seen = 0
        events = client.tree(tree) if tree else client.subscribe(pattern)
        async for event in events:
            print_event(event, as_json=as_json)
            seen += 1
            if count is not None and seen >= count:
                break
    return EXIT_OK


async def run_cancel_command(
    *,
    amqp_url: str,
    tls: TlsFiles | None = None,
    turn_id: str,
    reason: str,
    session: str | None,
    by: str | None,
) -> int:
    """Publish a ``turn.cancel``; the turn's own publisher gets its result."""
    try:
        cancel = TurnCancel(turn_id=turn_id, session_id=session, reason=reason, by=by)
    except ValidationError as exc:
        raise CliError(f"invalid cancel: {exc.errors()[0]['msg']}", code=2) from None
    async with connect(amqp_url, tls) as client:
        await client.cancel(cancel.turn_id, cancel.reason, session_id=cancel.session_id, by=by)
    sys.stdout.write(f"cancel of turn {turn_id} published\n")
    return EXIT_OK


@contextlib.asynccontextmanager
async def connect(amqp_url: str, tls: TlsFiles | None = None) -> AsyncIterator[LoopwireClient]:
    """A connected client; ``amqp_url`` may name several nodes, comma-separated; ``tls``: the
    TLS files of ``amqps://`` addresses."""
    client = LoopwireClient(amqp_url, tls=tls)
    try:
        await asyncio.wait_for(client.connect(), 15)
    except AmqpUnreachableError as exc:  # names each address (never a password) and why
        raise CliError(str(exc)) from None
    except (OSError, TimeoutError, ConnectionError) as exc:
        where = ", ".join(address(url) for url in client.amqp_urls)
        raise CliError(f"cannot reach RabbitMQ at {where}: {exc or type(exc).__name__}") from None
    try:
        yield client
    finally:
        await client.close()
