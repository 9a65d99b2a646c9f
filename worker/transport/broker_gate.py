"""Whether the worker's broker connection is whole again after a drop.

A robust connection restores its channels one after another, and a channel's
consumers start as soon as that channel is back. The work queue's consumer can
therefore receive a redelivered step while the channels the step publishes on
(events, next step, tool calls) and the tool reply queue are still being
restored. ``BrokerGate.up`` is cleared when the connection drops and set once
the connection reports that every channel has been restored; steps wait for it
before they start.
"""

from __future__ import annotations

import asyncio
import logging

from aio_pika.abc import AbstractRobustConnection

log = logging.getLogger("loopwire.broker")


class BrokerGate:
    def __init__(self) -> None:
        self.up = asyncio.Event()
        self.up.set()

    def watch(self, connection: AbstractRobustConnection) -> None:
        connection.close_callbacks.add(self._down)
        connection.reconnect_callbacks.add(self._restored)

    def _down(self, *_: object) -> None:
        if self.up.is_set():
            log.warning("broker connection lost: steps wait until every channel is restored")
        self.up.clear()

    def _restored(self, *_: object) -> None:
        log.info("broker connection restored with all its channels")
        self.up.set()
