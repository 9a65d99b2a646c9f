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
from contracts.session_client import SessionError
from contracts.turns import InputMessage, LimitOverrides, TurnResult
from worker.cli import arguments, exits
from worker.cli.output import print_event, print_result
from worker.errors import CliError

EXIT_OK = exits.OK
EXIT_ERROR = exits.ERROR
EXIT_TURN_FAILED = exits.TURN_FAILED
EXIT_MAX_ITERATIONS = exits.MAX_ITERATIONS


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
    tenant: str | None = None,
) -> int:
    limits = _limits(max_iterations)
    _check_turn(text=text, agent=agent, session=session, timeout=timeout, deadline_s=deadline_s)
    async with connect(amqp_url, tls, tenant) as client:
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
                result = await _wait(
                    handle, follow=follow, as_json=as_json, timeout=timeout, tenant=tenant
                )
        finally:
            await handle.close()
    if not stream or as_json:
        print_result(result, as_json=as_json)
    if result.finish_reason == "max_iterations":
        sys.stderr.write("note: the turn hit its iteration cap; the text above is not an answer\n")
        return EXIT_MAX_ITERATIONS
    if result.finish_reason != "stop":
        raise CliError(f"turn {result.turn_id} {ended(result)}", EXIT_TURN_FAILED)
    return EXIT_OK


def ended(result: TurnResult) -> str:
    """How a turn that gave no answer ended, in words: ``failed (model_error): ...``,
    ``cancelled: deadline``, ``cancelled: operator asked``."""
    if result.error is not None:
        return f"{result.finish_reason} ({result.error.code}): {result.error.message}"
    if result.stopped_by and result.stopped_by != result.finish_reason:
        return f"{result.finish_reason}: {result.stopped_by}"
    return result.finish_reason


def _limits(max_iterations: int | None) -> LimitOverrides:
    try:
        return LimitOverrides(max_tool_iterations=max_iterations)
    except ValidationError as exc:
        raise arguments.bad("--max-iterations", exc, max_iterations) from None


def _check_turn(
    *, text: str, agent: str, session: str | None, timeout: float, deadline_s: float | None
) -> None:
    """What a turn request would refuse, refused here with the option named."""
    arguments.safe_id(agent, "--agent")
    if session is not None:
        arguments.safe_id(session, "--session")
    try:
        InputMessage(content=text)
    except ValidationError as exc:
        raise arguments.bad("the message", exc) from None
    if not timeout > 0:
        raise CliError(f"--timeout {timeout:g}: must be more than 0 seconds", exits.USAGE)
    if deadline_s is not None and not deadline_s > 0:
        raise CliError(f"--deadline {deadline_s:g}: must be more than 0 seconds", exits.USAGE)


async def _wait(
    handle: TurnHandle, *, follow: bool, as_json: bool, timeout: float, tenant: str | None
) -> TurnResult:
    started = time.monotonic()
    progress = asyncio.create_task(
        _show_progress(handle, follow=follow, as_json=as_json, started=started)
    )
    try:
        return await handle.result(timeout)
    except TurnRejectedError as exc:
        raise CliError(f"turn rejected: {exc.reason}", EXIT_TURN_FAILED) from None
    except TimeoutError:
        within = f" --tenant {tenant}" if tenant is not None else ""
        raise CliError(
            f"no answer within {timeout:g} s; turn {handle.turn_id} may still be queued or running "
            f"(follow it with: loopwire{within} tail '*.*.*.{handle.turn_id}')"
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
    tenant: str | None = None,
) -> int:
    """Print events as they come: those matching ``pattern``, or (``tree``) those of a turn and
    of its child turns; with ``tenant``, that tenant's (bound within ``<tenant>.``)."""
    async with connect(amqp_url, tls, tenant) as client:
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
    tenant: str | None = None,
    rollback: bool = False,
) -> int:
    """Publish a ``turn.cancel``; the turn's own publisher gets its result."""
    arguments.safe_id(turn_id, "TURN_ID")
    if session is not None:
        arguments.safe_id(session, "--session")
    try:
        cancel = TurnCancel(turn_id=turn_id, session_id=session, reason=reason, by=by)
    except ValidationError as exc:
        options = {"reason": "--reason", "by": "--by"}
        raise arguments.bad_field(exc, options, "the cancel") from None
    async with connect(amqp_url, tls, tenant) as client:
        await ensure_unfinished(client, turn_id, session, "cancel")
        await client.cancel(
            cancel.turn_id, cancel.reason, session_id=cancel.session_id, by=by, rollback=rollback
        )
    sys.stdout.write(f"cancel of turn {turn_id} published\n")
    return EXIT_OK


async def ensure_unfinished(
    client: LoopwireClient, turn_id: str, session: str | None, what: str
) -> None:
    """A ``CliError`` (exit 5) unless a worker knows the turn and it has not finished: a
    worker would drop a control message for it. A worker too old to answer lets it through."""
    try:
        info = await client.sessions.turn(turn_id, session)
    except SessionError as exc:
        if exc.code == "bad_request":  # a worker that predates the turn lookup
            return
        raise CliError(f"cannot look turn {turn_id} up: {exc}") from None
    except TimeoutError:
        raise CliError(
            f"no worker answered the lookup of turn {turn_id} (is a worker running?)"
        ) from None
    if info is None:
        raise CliError(
            f"no turn {turn_id}: no worker has accepted a turn of that id, so there is nothing "
            f"to {what}",
            exits.NOT_FOUND,
        )
    if info.status == "done":
        raise CliError(
            f"turn {turn_id} has finished ({info.finish_reason or 'done'}): there is nothing "
            f"to {what}",
            exits.NOT_FOUND,
        )


@contextlib.asynccontextmanager
async def connect(
    amqp_url: str, tls: TlsFiles | None = None, tenant: str | None = None
) -> AsyncIterator[LoopwireClient]:
    """A connected client; ``amqp_url`` may name several nodes, comma-separated; ``tls``: the
    TLS files of ``amqps://`` addresses; ``tenant``: the tenant it acts for (its messages
    carry its user and the tenant, its subscriptions bind within ``<tenant>.``)."""
    client = LoopwireClient(amqp_url, tls=tls, tenant=tenant)
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
