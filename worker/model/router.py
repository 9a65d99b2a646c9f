"""The model a step asks, by provider: the loop's ``Model`` over one client per provider.

A request names its provider (``ModelRequest.provider``; ``None`` is ``default``, the
``LOOPWIRE_MODEL__*`` endpoint) and may carry a fallback chain (``ModelRequest.fallbacks``,
from a profile's ``models``). On a model error that the provider's own retries did not fix —
a 5xx, a timeout, a connection error, a malformed response — the next model of the chain is
asked; the answer records the provider that gave it (``ModelResponse.provider``, left unset
for ``default``). A 4xx other than 429 is the request's fault and no other model is asked; a
429 goes on to the next model when there is one, and parks the turn otherwise.

Without a chain the request goes straight to its provider's model, which encodes it at once
(nothing but the encoded body is held while the model thinks); a chain keeps the request
until an answer comes, to encode it for the next model.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable, Mapping

from contracts.state import ModelResponse
from worker.errors import ModelError
from worker.loop.ports import Model, ModelRequest

log = logging.getLogger("loopwire.model")

DEFAULT = "default"
FALLS_THROUGH = ("model_unavailable", "model_bad_response", "model_http_429")
"""The error codes after which the next model of a chain is asked (and any ``model_http_5xx``)."""

OnFallback = Callable[[str, str], None]
"""Told of each model error that sends a step on to the next model: provider, error code."""


def falls_through(error: ModelError) -> bool:
    return error.code in FALLS_THROUGH or error.code.startswith("model_http_5")


class ModelRouter:
    """``Model`` over named providers' models."""

    def __init__(self, models: Mapping[str, Model], on_fallback: OnFallback | None = None):
        if DEFAULT not in models:
            raise ValueError("the default provider is missing")
        self.models = dict(models)
        self.on_fallback = on_fallback

    def complete(self, request: ModelRequest) -> Awaitable[ModelResponse]:
        provider = request.provider or DEFAULT
        if not request.fallbacks:
            return self.models[provider].complete(request)
        return self._chain(request)

    async def _chain(self, request: ModelRequest) -> ModelResponse:
        chain = [(request.provider or DEFAULT, request.model), *request.fallbacks]
        for position, (provider, model) in enumerate(chain):
            attempt = dataclasses.replace(request, provider=provider, model=model, fallbacks=())
            try:
                return await self.models[provider].complete(attempt)
            except ModelError as exc:
                if position == len(chain) - 1 or not falls_through(exc):
                    raise
                log.warning(
                    "model %s of provider %s failed (%s): asking the next of the chain",
                    model or "(default)",
                    provider,
                    exc.code,
                )
                if self.on_fallback is not None:
                    self.on_fallback(provider, exc.code)
        raise AssertionError("unreachable")
