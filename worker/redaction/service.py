"""What the worker holds for the ``redact`` hook set: the vault and one redactor per profile.

``hooks(config)`` is called for every step and is cheap: the configuration's
detector (compiled patterns and its cache of scanned texts) is built once.
``deliver_for(configs)`` is the publisher's side: the copy of a result sent to
the reply queue, with placeholders restored when the agent's profile asks for it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

from contracts.turns import TurnResult
from worker.redaction.config import RedactionConfig
from worker.redaction.detectors import Detector
from worker.redaction.hooks import RedactionHooks
from worker.redaction.redactor import Redactor
from worker.redaction.vault import Vault

Deliver = Callable[[TurnResult], Awaitable[TurnResult]]


class Redaction:
    """The ``redact`` hook set's shared parts; ``default_ttl_s`` unless a profile sets ``ttl_s``."""

    def __init__(self, vault: Vault, *, default_ttl_s: int) -> None:
        self.vault = vault
        self.default_ttl_s = default_ttl_s
        self._redactors: dict[int, tuple[RedactionConfig, Redactor]] = {}

    def redactor(self, config: RedactionConfig) -> Redactor:
        """The redactor of ``config``, built the first time it is asked for."""
        cached = self._redactors.get(id(config))
        if cached is not None and cached[0] is config:
            return cached[1]
        redactor = Redactor(
            Detector(config),
            self.vault,
            ttl_s=config.ttl_s or self.default_ttl_s,
            labels=[*config.patterns, *config.literals],
        )
        self._redactors[id(config)] = (config, redactor)
        return redactor

    def hooks(self, config: RedactionConfig) -> RedactionHooks:
        """A fresh hook set for one step of an agent configured with ``config``."""
        return RedactionHooks(self.redactor(config))

    async def publisher_copy(
        self, config: RedactionConfig | None, result: TurnResult
    ) -> TurnResult:
        """``result`` with the session's placeholders restored, if ``config`` asks for it."""
        if config is None or not config.restore_answer or not result.content:
            return result
        restored = await self.redactor(config).restore(result.session_id, result.content)
        return result.model_copy(update={"content": restored.value})

    def deliver_for(self, configs: Mapping[str, RedactionConfig]) -> Deliver:
        """``SessionSequencer``'s ``deliver``: the publisher's copy of a result of any agent;
        ``configs``: the configuration of each agent that enables the hook set, by name."""

        async def deliver(result: TurnResult) -> TurnResult:
            return await self.publisher_copy(configs.get(result.agent), result)

        return deliver
