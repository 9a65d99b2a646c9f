"""``loopwire approvals``, ``loopwire approve`` and ``loopwire reject``: the tool calls that
wait for a human, and deciding them.

The list is read from the worker's Redis (every call a parked turn waits on is listed there
while it waits); a decision is a ``turn.decision`` control message on the broker, applied by
whichever worker takes it.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, Literal

from pydantic import ValidationError

from contracts.control import TurnDecision
from contracts.runtime.redis_client import redis_client
from contracts.runtime.tls import TlsFiles
from worker.cli.turns import EXIT_OK, connect
from worker.errors import CliError
from worker.session.store import RedisStore


async def list_approvals(
    *, redis_url: str, as_json: bool, cluster: bool = False, tls: TlsFiles | None = None
) -> int:
    redis = redis_client(redis_url, cluster=cluster, tls=tls)
    try:
        waiting = await RedisStore(redis).approvals()
    except OSError as exc:
        raise CliError(f"cannot reach Redis: {exc}") from None
    finally:
        await redis.aclose()
    now = time.time()
    for request in waiting:
        if as_json:
            sys.stdout.write(request.model_dump_json() + "\n")
            continue
        left = f"{max(0, round(request.until - now))}s left" if request.until else "no timeout"
        sys.stdout.write(
            f"{request.turn_id} {request.call_id} {request.agent}/{request.tool} "
            f"{request.arguments} ({left}, session {request.session_id})\n"
        )
    if not waiting and not as_json:
        sys.stdout.write("no tool call waits for a decision\n")
    return EXIT_OK


async def decide(
    *,
    amqp_url: str,
    tls: TlsFiles | None = None,
    turn_id: str,
    call_id: str,
    verdict: Literal["approve", "reject"],
    arguments: str | None,
    message: str | None,
    by: str | None,
) -> int:
    edited: dict[str, Any] | None = None
    if arguments is not None:
        try:
            edited = json.loads(arguments)
        except ValueError as exc:
            raise CliError(f"--arguments is not JSON: {exc}", code=2) from None
        if not isinstance(edited, dict):
            raise CliError("--arguments must be a JSON object", code=2)
    try:
        decision = TurnDecision(
            turn_id=turn_id,
            call_id=call_id,
            decision="edit" if edited is not None else verdict,
            arguments=edited,
            message=message,
            by=by,
        )
    except ValidationError as exc:
        raise CliError(f"invalid decision: {exc.errors()[0]['msg']}", code=2) from None
    async with connect(amqp_url, tls) as client:
        await client.decide(
            decision.turn_id,
            decision.call_id,
            decision.decision,
            message=decision.message,
            arguments=decision.arguments,
            by=decision.by,
        )
    sys.stdout.write(f"{decision.decision} of call {call_id} of turn {turn_id} published\n")
    return EXIT_OK
