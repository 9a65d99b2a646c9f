"""Who may send what on ``loopwire.turns``.

Any publisher may start a turn, cancel it, decide its calls and delete its session. Only a
worker may start a child turn (a ``TurnRequest`` with ``parent``) or deliver a child turn's
result (``turn.child_result``): the message's ``user_id``, which RabbitMQ refuses unless it is
the publishing connection's own user, must be one of the workers' users (this worker's own
among them), and a result must be the one of the child its parent's call started (the child
turn id derived from the parent's turn id and the call id). Anything else is refused
(``PermanentError``, code ``forbidden``: the consumer dead-letters it).

The worker publishes its turn work with its own user as ``user_id`` (``Outbox``); what it
sends on of a message it received (a retry, a dead letter) keeps that voucher, under its own
user, only when the message had it.
"""

from __future__ import annotations

from collections.abc import Collection

from contracts.control import TurnChildResult
from contracts.turns import TurnRequest
from worker.errors import PermanentError
from worker.loop.children import misdirected


class Senders:
    def __init__(self, user: str | None = None, workers: Collection[str] = ()) -> None:
        self.user = user
        """This worker's AMQP user: the ``user_id`` of the turn work it publishes."""
        self.workers = frozenset(workers) | ({user} if user else frozenset())
        """The users whose messages may start a child turn or deliver a child's result."""

    def vet_request(self, request: TurnRequest, sender: str | None) -> None:
        if request.parent is not None:
            self._from_a_worker(sender, "a child turn's request (a TurnRequest with parent)")

    def vet_child_result(self, message: TurnChildResult, sender: str | None) -> None:
        self._from_a_worker(sender, "a child turn's result (turn.child_result)")
        wrong = misdirected(message)
        if wrong is not None:
            raise PermanentError(f"not the result of the call's child: {wrong}", code="forbidden")

    def voucher(self, sender: str | None) -> str | None:
        """The ``user_id`` of what this worker sends on of a message from ``sender``."""
        return self.user if sender is not None and sender in self.workers else None

    def _from_a_worker(self, sender: str | None, what: str) -> None:
        if sender is None or sender not in self.workers:
            by = "no user_id" if sender is None else f"user_id {sender[:64]!r}"
            raise PermanentError(
                f"{what} is taken only from a worker's AMQP user; this message has {by}",
                code="forbidden",
            )
