"""``loopwire session show|history|delete ID`` and ``loopwire result TURN_ID``: sessions as a
resource, over the broker like any publisher (``contracts.session_client``). With a tenant
(``--tenant``), the reads and the deletion carry it, and the worker answers from that
tenant's sessions."""

from __future__ import annotations

import sys

from contracts.runtime.tls import TlsFiles
from contracts.session_client import SessionError, Sessions
from worker.cli import arguments, exits
from worker.cli.output import print_result, to_json
from worker.cli.turns import connect
from worker.errors import CliError

EXIT_OK = exits.OK
EXIT_NOT_FOUND = exits.NOT_FOUND


async def run_session_command(
    *,
    amqp_url: str,
    tls: TlsFiles | None = None,
    command: str,
    session_id: str,
    as_json: bool,
    yes: bool,
    limit: int,
    tenant: str | None = None,
) -> int:
    arguments.safe_id(session_id, "SESSION_ID")
    if not 1 <= limit <= 1000:
        raise CliError(f"--limit {limit}: must be 1 to 1000", exits.USAGE)
    if command == "delete" and not yes:
        raise CliError(f"this deletes session {session_id} for good: add --yes", exits.USAGE)
    run = {"show": _show, "history": _history, "delete": _delete}[command]
    async with connect(amqp_url, tls, tenant) as client:
        try:
            await run(client.sessions, session_id, as_json=as_json, limit=limit)
        except SessionError as exc:
            raise CliError(
                str(exc), code=EXIT_NOT_FOUND if exc.code == "not_found" else 1
            ) from None
        except TimeoutError:
            raise CliError(NO_WORKER) from None
    return EXIT_OK


async def _show(sessions: Sessions, session_id: str, *, as_json: bool, limit: int) -> None:
    summary = await sessions.get(session_id)
    if summary is None:
        raise CliError(f"no session {session_id}", code=EXIT_NOT_FOUND)
    if as_json:
        sys.stdout.write(to_json(summary) + "\n")
        return
    turns = await sessions.turns(session_id)
    sys.stdout.write(
        f"session {summary.session_id} (agent {summary.agent}): {summary.turns} "
        f"turn(s) done, {summary.history_len} message(s), "
        f"{summary.spent.total_tokens} tokens, ${summary.spent.cost_usd:.4f}\n"
    )
    if summary.running:
        state = "parked" if summary.parked else "running"
        sys.stdout.write(f"  {state}: {summary.running}; {summary.queued} queued\n")
    for turn in turns:
        sys.stdout.write(f"  {turn.turn_id}  {turn.status}  {turn.finish_reason or ''}\n")


async def _history(sessions: Sessions, session_id: str, *, as_json: bool, limit: int) -> None:
    messages, total = await sessions.history(session_id, limit=limit, newest_first=True)
    for message in reversed(messages):  # the newest, in conversation order
        if as_json:
            sys.stdout.write(to_json(message) + "\n")
            continue
        calls = ", ".join(c.name for c in message.tool_calls)
        text = (message.content or "").replace("\n", " ")
        sys.stdout.write(f"{message.role:<9} {text[:200]}{'  -> ' + calls if calls else ''}\n")
    if not as_json:
        sys.stdout.write(f"({len(messages)} of {total} message(s), the newest)\n")


async def _delete(sessions: Sessions, session_id: str, *, as_json: bool, limit: int) -> None:
    deleted = await sessions.delete(session_id, by="loopwire session delete")
    if as_json:
        sys.stdout.write(to_json({"session_id": session_id, "deleted_keys": deleted}) + "\n")
    else:
        sys.stdout.write(f"session {session_id} deleted ({deleted} key(s))\n")


NO_WORKER = "no worker answered in time (is a worker running on this broker and vhost?)"


async def run_result_command(
    *,
    amqp_url: str,
    tls: TlsFiles | None = None,
    turn_id: str,
    as_json: bool,
    tenant: str | None = None,
) -> int:
    arguments.safe_id(turn_id, "TURN_ID")
    async with connect(amqp_url, tls, tenant) as client:
        try:
            result = await client.sessions.result(turn_id)
        except TimeoutError:
            raise CliError(NO_WORKER) from None
    if result is None:
        raise CliError(f"no result for turn {turn_id}", code=EXIT_NOT_FOUND)
    print_result(result, as_json=as_json)
    return EXIT_OK
