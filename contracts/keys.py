"""Every Redis key loopwire uses, built in this one module.

The keys of one session share the hash tag ``{<session_id>}`` so that the
multi-key Lua scripts keep working on Redis Cluster. Keys of one tool call share
the tag of its idempotency key. Session and turn ids are restricted to a safe
charset by the contracts, so they can never contain a brace; a tool call id
comes from the model and may, but both keys of a call are built from the same
idempotency key, so they always hash to the same slot.

Within a tenant other than ``default`` (``contracts.tenancy``), a session's hash tag and a
turn's index hold ``<tenant>/<id>``: the keys of the task's current tenant are built here, so
no caller can reach another tenant's session by naming its id.
"""

from __future__ import annotations

from typing import Final

from contracts.tenancy import DEFAULT, current, scoped

PREFIX: Final = "lw"


def session_state(session_id: str) -> str:
    """Hash ``{v: version, s: AgentState}``: the state as JSON without the fields at their
    defaults (``codec.encode_stored``); msgpack, as earlier versions wrote it, is read too."""
    return f"{PREFIX}:{{{scoped(session_id)}}}:state"


def session_history(session_id: str) -> str:
    """List of msgpack ``ChatMessage``: the session's history, appended to (cut back only by
    a cancel with rollback)."""
    return f"{PREFIX}:{{{scoped(session_id)}}}:history"


def turn_transient(session_id: str, turn_id: str) -> str:
    """List of msgpack ``ChatMessage`` of a ``persist: false`` turn, dropped when it ends."""
    return f"{PREFIX}:{{{scoped(session_id)}}}:turn:{turn_id}:messages"


def turn_steps(session_id: str, turn_id: str) -> str:
    """List of msgpack ``StepExecution`` (``StepExecution.stored``): the records of the turn's
    completed steps, each appended once by the save that completes its step and never
    rewritten; it lives with the session's keys (``ttl_s`` past the turn's end), for a
    ``persist: false`` turn too."""
    return f"{PREFIX}:{{{scoped(session_id)}}}:turn:{turn_id}:steps"


def session_lease(session_id: str) -> str:
    """String: the fencing token of the worker that holds the session, with a TTL."""
    return f"{PREFIX}:{{{scoped(session_id)}}}:lease"


def session_fence(session_id: str) -> str:
    """Integer: the last fencing token handed out for the session (monotonic: erasing the
    session keeps it, until its expiry)."""
    return f"{PREFIX}:{{{scoped(session_id)}}}:fence"


def session_queue(session_id: str) -> str:
    """List of turn ids waiting for the session, in arrival order."""
    return f"{PREFIX}:{{{scoped(session_id)}}}:queue"


def session_turns(session_id: str) -> str:
    """Hash turn id → status: every turn the session has accepted (for duplicate detection)."""
    return f"{PREFIX}:{{{scoped(session_id)}}}:turns"


def session_requests(session_id: str) -> str:
    """Hash turn id → msgpack ``TurnRequest`` of turns waiting for the session."""
    return f"{PREFIX}:{{{scoped(session_id)}}}:requests"


def session_replies(session_id: str) -> str:
    """Hash turn id → reply_to of the session's turns, kept after they finish (to re-send a result)."""
    return f"{PREFIX}:{{{scoped(session_id)}}}:replies"


def turn_result(session_id: str, turn_id: str) -> str:
    """msgpack ``TurnResult`` stored under the turn id (readable later, with a TTL)."""
    return f"{PREFIX}:{{{scoped(session_id)}}}:turn:{turn_id}:result"


def tool_call(idempotency_key: str) -> str:
    """Hash with the claim and the stored reply of one tool call (idempotency, with a TTL)."""
    return f"{PREFIX}:toolcall:{{{idempotency_key}}}"


def session_calls(session_id: str) -> str:
    """Set of the idempotency keys of every tool call the session's turns sent (written with
    the model answer that asked for them): what erasing the session deletes beside it."""
    return f"{PREFIX}:{{{scoped(session_id)}}}:calls"


def tool_registry() -> str:
    """Hash instance id → msgpack ``ToolAnnouncement``: live tool services (heartbeat)."""
    return f"{PREFIX}:tools:registry"


def redaction_map(session_id: str) -> str:
    """Hash placeholder ↔ value of the session's redaction mapping, with a TTL."""
    return f"{PREFIX}:{{{scoped(session_id)}}}:redaction"


def tool_call_lease(idempotency_key: str) -> str:
    """String with a short PX TTL, kept alive by the owner of a running tool call.

    Shares the hash tag of ``tool_call`` so that one Lua script can touch both.
    """
    return f"{tool_call(idempotency_key)}:lease"


def session_notes(session_id: str) -> str:
    """List of msgpack notes filed for the session by the ``notes`` tool service."""
    return f"{PREFIX}:{{{scoped(session_id)}}}:notes"


def session_notes_filed(session_id: str) -> str:
    """Hash of the ``notes`` tool service: idempotency key of a call -> the count its note
    made, so a call whose write is retried after a lost reply files its note once."""
    return f"{session_notes(session_id)}:filed"


def turn_controls(session_id: str, turn_id: str) -> str:
    """Hash of the control messages recorded for a turn (field ``cancel``: the
    ``TurnCancel``); read with the lease by every step, deleted when the turn ends."""
    return f"{PREFIX}:{{{scoped(session_id)}}}:turn:{turn_id}:controls"


def session_erasing(session_id: str) -> str:
    """String: the fencing token of the erasure under way (``session.delete``), with a TTL;
    while the session's lease holds that token it accepts no turn (the request comes back
    later)."""
    return f"{PREFIX}:{{{scoped(session_id)}}}:erasing"


def session_children(session_id: str) -> str:
    """Set of the child sessions the session's turns started in sessions derived from it (not
    the ones a profile names): deleted with the session when the session is."""
    return f"{PREFIX}:{{{scoped(session_id)}}}:children"


def session_thread(session_id: str) -> str:
    """Hash ``{created_at, metadata}``: the session as a thread of the HTTP gateway
    (``gateway.http``), written when a client creates the thread; expires as the session's
    keys do, renewed by each run the gateway starts in it; erased with the session."""
    return f"{PREFIX}:{{{scoped(session_id)}}}:thread"


def thread_index() -> str:
    """Sorted set: the threads the HTTP gateway created (session id -> created at), one per
    tenant (``lw:threads:<tenant>``); an entry whose thread is gone is dropped when a search
    finds it."""
    tenant = current()
    return f"{PREFIX}:threads:{tenant or DEFAULT}"


def turn_webhook(turn_id: str) -> str:
    """String: the URL the HTTP gateway posts a run's end to (its ``webhook``), from the run's
    creation until it was delivered; expires as the session's keys do."""
    return f"{PREFIX}:webhook:{scoped(turn_id)}"


def turn_session(turn_id: str) -> str:
    """String: the session of a turn, written when the turn is accepted, so that a control
    message may name the turn alone; it expires ``ttl_s`` after that, or after the last save
    that parked or ended the turn (``worker.session.store``)."""
    return f"{PREFIX}:turn:{scoped(turn_id)}:session"


def approvals_waiting() -> str:
    """Hash of every tool call waiting for a decision, fleet-wide: ``<turn_id>:<call_id>`` ->
    JSON ``ApprovalRequest`` (what ``loopwire approvals`` lists); removed when decided. One
    hash per tenant: ``lw:approvals:<tenant>:waiting`` for a tenant other than ``default``."""
    tenant = current()
    if tenant is None or tenant == DEFAULT:
        return f"{PREFIX}:approvals:waiting"
    return f"{PREFIX}:approvals:{tenant}:waiting"


def agent_spend(agent: str, day: str) -> str:
    """Hash of what an agent's finished turns spent on one day (UTC, ``YYYY-MM-DD``):
    ``total_tokens``, ``cost_usd``, ``tool_calls``, ``wall_s``; kept two days."""
    return f"{PREFIX}:spend:{agent}:{day}"


def rate_limit(endpoint: str, limit: str) -> str:
    """String: a model endpoint's rate-limit state (``requests`` or ``tokens``); both of one
    endpoint share its hash tag (the admission script reads both)."""
    return f"{PREFIX}:rate:{{{endpoint}}}:{limit}"


def tenant_rate_limit(tenant: str, limit: str) -> str:
    """String: a tenant's own model rate-limit state (``requests`` or ``tokens``), asked beside
    the endpoint's (``worker.model.ratelimit``); both share the tenant's hash tag."""
    return f"{PREFIX}:rate:{{tenant:{tenant}}}:{limit}"
