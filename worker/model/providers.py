"""The workers' model endpoints: ``default`` (``LOOPWIRE_MODEL__*``) and the named providers of
``LOOPWIRE_PROVIDERS``, each an ``openai`` client with its own key, timeouts, retries and
connection pool, behind one ``ModelRouter``.

Every provider a profile names must be configured: a profile naming another, or a provider
whose key cannot be read, stops the worker at start (and fails ``loopwire agents check``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping

import httpx2
from openai import AsyncOpenAI

from worker.errors import ProfileError
from worker.loop.ports import Model
from worker.model.adapter import OpenAIModel
from worker.model.http import ModelClient, ModelHttpClient
from worker.model.router import DEFAULT, ModelRouter, OnFallback
from worker.profiles.agents import AgentProfile
from worker.settings import ModelSettings, ProviderSettings, Settings


def endpoints(settings: Settings) -> dict[str, ModelSettings]:
    """Every provider by name, ``default`` first."""
    if DEFAULT in settings.providers:
        raise ProfileError("LOOPWIRE_PROVIDERS may not define 'default': it is LOOPWIRE_MODEL__*")
    return {DEFAULT: settings.model, **settings.providers}


def check_providers(profiles: Iterable[AgentProfile], known: Iterable[str]) -> list[str]:
    """The problems of profiles naming providers that are not configured."""
    names = set(known)
    return [
        f"agent {profile.name!r} names provider {choice.provider!r}, which is not configured "
        f"(configured: {', '.join(sorted(names))})"
        for profile in profiles
        for choice in profile.route
        if choice.provider not in names
    ]


def client_for(m: ModelSettings, api_key: str) -> AsyncOpenAI:
    return ModelClient(
        base_url=m.base_url,
        api_key=api_key,
        max_retries=m.max_retries,
        timeout=httpx2.Timeout(m.timeout_s, connect=m.connect_timeout_s),
        # the client's aiohttp transport (httpx's own pool costs more CPU per call, the more so
        # with concurrent calls), minus httpx's per-call merging layers (tests/bench)
        http_client=ModelHttpClient(
            limits=httpx2.Limits(
                max_connections=m.max_connections, max_keepalive_connections=m.max_connections
            ),
            timeout=httpx2.Timeout(m.timeout_s, connect=m.connect_timeout_s),
        ),
    )


def build_models(
    settings: Settings,
    *,
    environ: Mapping[str, str] | None = None,
    on_fallback: OnFallback | None = None,
    wrap: Callable[[Model, str, ModelSettings], Model] | None = None,
) -> tuple[ModelRouter, list[AsyncOpenAI]]:
    """The router over every provider's model, and the clients (to close at exit); ``wrap``
    (model, provider name, its settings) wraps each provider's model (tracing)."""
    environ = os.environ if environ is None else environ
    clients: list[AsyncOpenAI] = []
    models = {}
    for name, m in endpoints(settings).items():
        try:
            key = (
                m.key(environ) if isinstance(m, ProviderSettings) else m.api_key.get_secret_value()
            )
        except (OSError, ValueError) as exc:
            raise ProfileError(f"provider {name!r}: cannot read its API key: {exc}") from None
        client = client_for(m, key)
        clients.append(client)
        model: Model = OpenAIModel(
            client,
            model=m.model,
            bad_response_retries=m.bad_response_retries,
            provider=None if name == DEFAULT else name,
        )
        models[name] = model if wrap is None else wrap(model, name, m)
    return ModelRouter(models, on_fallback=on_fallback), clients
