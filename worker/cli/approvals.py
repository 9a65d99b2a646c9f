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
from redis.exceptions import RedisError

from contracts import tenancy
from contracts.control import TurnDecision
from contracts.runtime.redis_client import (
    RedisUnreachableError,
    address,
    check,
    redis_client,
)
from contracts.runtime.tls import TlsFiles
from worker.cli import arguments as checks
from worker.cli.turns import EXIT_OK, connect, ensure_unfinished
from worker.errors import CliError
from worker.session.store import RedisStore


async def list_approvals(
    *,
    redis_url: str,
    as_json: bool,
    cluster: bool = False,
    tls: TlsFiles | None = None,
    tenant: str | None = None,
) -> int:
    """The calls waiting for a decision; with ``tenant``, that tenant's (``contracts.keys``
    names its list of them)."""
    redis = redis_client(redis_url, cluster=cluster, tls=tls)
    try:
        await check(redis, redis_url)  # RedisUnreachableError: one line, naming the address
        with tenancy.acting_for(tenant):
            waiting = await RedisStore(redis).approvals()
    except RedisUnreachableError:
        raise
    except (RedisError, OSError) as exc:
        raise CliError(f"lost Redis at {address(redis_url)}: {exc}") from None
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
    tenant: str | None = None,
) -> int:
    checks.safe_id(turn_id, "TURN_ID")
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
        options = {"call_id": "CALL_ID", "message": "--message", "by": "--by"}
        raise checks.bad_field(exc, options, "the decision") from None
    async with connect(amqp_url, tls, tenant) as client:
        await ensure_unfinished(client, turn_id, None, verdict)
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
