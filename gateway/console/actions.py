"""What a person does from the console: cancel a turn, decide a call, delete a session, replay
or purge a dead letter, switch tenant (an admin key). Each goes out as the same control
message any service could send (``turn.cancel``, ``turn.decision``, ``session.delete``) or
the same dead-letter operation as ``loopwire dlq``, with ``by`` = ``console:<key name>``, and
is recorded in the tenant's list of console actions (who, what, on what, what came of it).

Forms post back to the page they came from (``303``), which shows what happened; the browser
sends them with the ``SameSite=Strict`` cookie only from the console's own pages.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

import jsonschema
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response

from contracts.dead_letters import NotReplayableError, purge, replay
from contracts.registry import live_tools
from contracts.session_client import SessionError
from gateway.console.pages import Pages
from gateway.console.viewer import TENANT_COOKIE, Viewer

Verdict = str


def back(path: str, *, said: str = "", error: str = "") -> Response:
    query = f"?said={quote(said)}" if said else f"?error={quote(error)}" if error else ""
    return RedirectResponse(f"/console{path}{query}", status_code=303)


class Actions:
    def __init__(self, pages: Pages) -> None:
        self.pages = pages
        self.index = pages.index

    async def _done(self, seen: Viewer, action: str, target: str, outcome: str) -> None:
        await self.index.act(seen.tenant, seen.by, action, target, outcome)

    async def cancel(self, request: Request, seen: Viewer) -> Response:
        turn_id = request.path_params["turn_id"]
        form = await request.form()
        reason = str(form.get("reason") or "").strip()[:120] or "cancelled from the console"
        client = await self.pages.fleet.client(seen.acting_for)
        if await client.sessions.turn(turn_id) is None:
            return back(f"/turns/{turn_id}", error=f"no turn {turn_id}")
        await client.cancel(turn_id, reason, by=seen.by)
        await self._done(seen, "cancel", turn_id, f"turn.cancel sent: {reason}")
        return back(f"/turns/{turn_id}", said=f"Cancel sent: {reason}")

    async def decide(self, request: Request, seen: Viewer) -> Response:
        turn_id, call_id = request.path_params["turn_id"], request.path_params["call_id"]
        form = await request.form()
        decision = str(form.get("decision") or "")
        waiting = {(a.turn_id, a.call_id): a for a in await self.pages.waiting()}
        asked = waiting.get((turn_id, call_id))
        if asked is None:
            return back("/approvals", error=f"call {call_id} of turn {turn_id} is not waiting")
        arguments: dict[str, Any] | None = None
        message = str(form.get("message") or "").strip()[:2000] or None
        if decision == "edit":
            problems, arguments = await self.check(asked.tool, str(form.get("arguments") or ""))
            if problems:
                return back("/approvals", error=f"not sent: {problems[0]}")
        elif decision not in ("approve", "reject"):
            return back("/approvals", error=f"not a decision: {decision[:40]!r}")
        client = await self.pages.fleet.client(seen.acting_for)
        await client.decide(
            turn_id,
            call_id,
            decision,  # type: ignore[arg-type]
            message=message,
            arguments=arguments,
            by=seen.by,
            session_id=asked.session_id,
        )
        said = f"{decision} sent for {asked.tool} ({call_id}) of turn {turn_id}"
        await self._done(seen, f"decision.{decision}", f"{turn_id}/{call_id}", said)
        return back("/approvals", said=said.capitalize())

    async def check(self, tool: str, text: str) -> tuple[list[str], dict[str, Any] | None]:
        """Problems with ``text`` as the arguments of ``tool`` (JSON, then its schema)."""
        try:
            arguments = json.loads(text)
        except ValueError as exc:
            return [f"the arguments are not JSON: {exc}"], None
        if not isinstance(arguments, dict):
            return ["the arguments must be a JSON object"], None
        definition = (await live_tools(self.index.redis)).get(tool)
        if definition is None:
            return [], arguments  # the tool is not announced now: the worker checks again
        validator = jsonschema.Draft202012Validator(definition.parameters)
        problems = [
            f"{'/'.join(str(p) for p in e.absolute_path) or 'arguments'}: {e.message}"
            for e in validator.iter_errors(arguments)
        ]
        return problems, arguments

    async def validate(self, request: Request, seen: Viewer) -> Response:
        """The editor's live check: ``{"tool", "arguments"}`` → ``{"problems": [...]}``."""
        try:
            body = json.loads(await request.body())
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return JSONResponse({"problems": ['the body is {"tool": ..., "arguments": ...}']}, 422)
        problems, _ = await self.check(str(body.get("tool", "")), str(body.get("arguments", "")))
        return JSONResponse({"problems": problems})

    async def delete_session(self, request: Request, seen: Viewer) -> Response:
        session_id = request.path_params["session_id"]
        form = await request.form()
        if str(form.get("confirm") or "") != session_id:
            return back(
                f"/sessions/{session_id}", error="type the session's id to confirm the deletion"
            )
        client = await self.pages.fleet.client(seen.acting_for)
        try:
            removed = await client.sessions.delete(session_id, reason="console", by=seen.by)
        except SessionError as exc:
            return back(f"/sessions/{session_id}", error=str(exc))
        outcome = f"deleted ({removed} keys removed)"
        await self._done(seen, "session.delete", session_id, outcome)
        return back("", said=f"Session {session_id} {outcome}")

    async def replay(self, request: Request, seen: Viewer) -> Response:
        letter, fleet = request.path_params["letter_id"], self.pages.fleet
        try:
            found = await replay(fleet.amqp_urls[0], letter, fleet.tls, seen.letters_of)
        except NotReplayableError as exc:
            await self._done(seen, "dead-letter.replay", letter, f"refused: {exc}")
            return back("/dead-letters", error=str(exc))
        if found is None:
            return back("/dead-letters", error=f"no dead letter {letter}")
        outcome = f"replayed to the turn queue (turn {found.turn_id or '-'}, was {found.code})"
        await self._done(seen, "dead-letter.replay", letter, outcome)
        return back("/dead-letters", said=f"{letter}: {outcome}")

    async def purge(self, request: Request, seen: Viewer) -> Response:
        letter, fleet = request.path_params["letter_id"], self.pages.fleet
        removed = await purge(fleet.amqp_urls[0], letter, fleet.tls, seen.letters_of)
        if not removed:
            return back("/dead-letters", error=f"no dead letter {letter}")
        outcome = f"purged (turn {removed[0].turn_id or '-'}, {removed[0].code})"
        await self._done(seen, "dead-letter.purge", letter, outcome)
        return back("/dead-letters", said=f"{letter}: {outcome}")

    async def switch(self, request: Request, seen: Viewer) -> Response:
        """An admin key's tenant switch (a cookie; the viewer checks the key is an admin's)."""
        form = await request.form()
        tenant = str(form.get("tenant") or "")
        response = back("")
        if seen.key.admin:
            response.set_cookie(
                TENANT_COOKIE, tenant, httponly=True, samesite="strict", path="/console"
            )
        return response
