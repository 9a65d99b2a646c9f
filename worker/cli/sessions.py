"""``loopwire session show|history|delete ID`` and ``loopwire result TURN_ID``: sessions as a
resource, over the broker like any publisher (``contracts.session_client``)."""

from __future__ import annotations

import sys

from contracts.runtime.tls import TlsFiles
from contracts.session_client import SessionError
from worker.cli.output import print_result, to_json
from worker.cli.turns import connect
from worker.errors import CliError

EXIT_OK = 0
EXIT_NOT_FOUND = 5


async def run_session_command(
    *,
    amqp_url: str,
    tls: TlsFiles | None = None,
    command: str,
    session_id: str,
    as_json: bool,
    yes: bool,
    limit: int,
) -> int:
    async with connect(amqp_url, tls) as client:
        try:
            if command == "show":
                summary = await client.sessions.get(session_id)
                if summary is None:
                    raise CliError(f"no session {session_id}", code=EXIT_NOT_FOUND)
                if as_json:
                    sys.stdout.write(to_json(summary) + "\n")
                    return EXIT_OK
                turns = await client.sessions.turns(session_id)
                sys.stdout.write(
                    f"session {summary.session_id} (agent {summary.agent}): {summary.turns} "
                    f"turn(s) done, {summary.history_len} message(s), "
                    f"{summary.spent.total_tokens} tokens, ${summary.spent.cost_usd:.4f}\n"
                )
                if summary.running:
                    state = "parked" if summary.parked else "running"
                    sys.stdout.write(f"  {state}: {summary.running}; {summary.queued} queued\n")
                for turn in turns:
                    sys.stdout.write(
                        f"  {turn.turn_id}  {turn.status}  {turn.finish_reason or ''}\n"
                    )
                return EXIT_OK
            if command == "history":
                messages, total = await client.sessions.history(
                    session_id, limit=limit, newest_first=True
                )
                for message in reversed(messages):  # the newest, in conversation order
                    if as_json:
                        sys.stdout.write(to_json(message) + "\n")
                        continue
                    calls = ", ".join(c.name for c in message.tool_calls)
                    text = (message.content or "").replace("\n", " ")
                    sys.stdout.write(
                        f"{message.role:<9} {text[:200]}{'  -> ' + calls if calls else ''}\n"
                    )
                if not as_json:
                    sys.stdout.write(f"({len(messages)} of {total} message(s), the newest)\n")
                return EXIT_OK
            if not yes:
                raise CliError(f"this deletes session {session_id} for good: add --yes", code=2)
            deleted = await client.sessions.delete(session_id, by="loopwire session delete")
            sys.stdout.write(f"session {session_id} deleted ({deleted} key(s))\n")
            return EXIT_OK
        except SessionError as exc:
            raise CliError(
                str(exc), code=EXIT_NOT_FOUND if exc.code == "not_found" else 1
            ) from None


async def run_result_command(
    *, amqp_url: str, tls: TlsFiles | None = None, turn_id: str, as_json: bool
) -> int:
    async with connect(amqp_url, tls) as client:
        result = await client.sessions.result(turn_id)
    if result is None:
        raise CliError(f"no result for turn {turn_id}", code=EXIT_NOT_FOUND)
    print_result(result, as_json=as_json)
    return EXIT_OK
