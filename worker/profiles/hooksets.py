"""Hook sets an agent profile enables: a built-in name (``"redact"``, ``"tool_guard"``,
``"content_guard"``: ``worker.profiles.guards``) or an import path.

An import path names a ``Hook`` subclass, ``"mypkg.guards:NoRefunds"``. If the class has
a ``Config`` attribute (a pydantic model), the profile's ``hook_config`` block for that
name is validated by it and passed to the constructor; a class without one takes no
arguments and no config. Every hook set of every profile is resolved when the profiles
load, so a name that does not import or a config that does not validate stops the worker
at start with the profile and the hook named, never mid-turn.

A hook set gives a fresh ``Hook`` per step (``HookSets.for_agent``): a hook keeps no
state between steps in the process, since the next step may run on another worker.
Several sets run in the order the profile lists them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any, Final

from pydantic import BaseModel, ValidationError

from worker.errors import ProfileError
from worker.loop.hooks import Hook, Hooks
from worker.profiles.agents import AgentProfile, AgentProfiles
from worker.profiles.guards import BUILT_IN
from worker.redaction import REDACT
from worker.redaction.service import Redaction

HookFactory = Callable[[], Hook]

_NO_HOOKS: Final = Hooks()


def _import(path: str) -> object:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError("expected a built-in name or 'module:attribute'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import {module_name!r}: {exc}") from exc
    target: object = module
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ValueError(f"{module_name!r} has no attribute {attr!r}") from None
    return target


def _plugin(path: str, config: Mapping[str, Any] | None) -> HookFactory:
    target = _import(path)
    if not (isinstance(target, type) and issubclass(target, Hook)):
        raise ValueError(f"{path!r} is not a subclass of worker.loop.hooks.Hook")
    return _configured(target, config)


def _configured(target: type[Hook], config: Mapping[str, Any] | None) -> HookFactory:
    model = getattr(target, "Config", None)
    if isinstance(model, type) and issubclass(model, BaseModel):
        try:
            validated = model.model_validate(config or {})
        except ValidationError as exc:
            raise ValueError(f"invalid hook_config: {exc}") from None
        hook_class: Callable[..., Hook] = target
        return lambda: hook_class(validated)
    if config:
        raise ValueError("hook_config given, but the hook declares no Config model")
    return target


def _factory(profile: AgentProfile, name: str, redaction: Redaction | None) -> HookFactory:
    if name == REDACT:
        if redaction is None:
            raise ValueError("the hook set needs the worker's Redis")
        config = profile.redaction
        return lambda: redaction.hooks(config)
    if name in BUILT_IN:
        if name not in profile.hook_config:
            raise ValueError(f"the hook set needs its configuration: hook_config[{name!r}]")
        return _configured(BUILT_IN[name], profile.hook_config[name])
    return _plugin(name, profile.hook_config.get(name))


class HookSets:
    """Every profile's hook sets, resolved once."""

    def __init__(self, profiles: AgentProfiles, redaction: Redaction | None = None) -> None:
        self._factories: dict[str, tuple[HookFactory, ...]] = {}
        for profile in profiles.agents:
            factories = []
            for name in profile.hooks:
                try:
                    factories.append(_factory(profile, name, redaction))
                except ValueError as exc:
                    raise ProfileError(
                        f"agent {profile.name!r}, hook set {name!r}: {exc}"
                    ) from None
            self._factories[profile.name] = tuple(factories)

    def for_agent(self, agent: str) -> Hook:
        """The hooks of one step of ``agent``."""
        factories = self._factories.get(agent, ())
        if not factories:
            return _NO_HOOKS
        if len(factories) == 1:
            return factories[0]()
        return Hooks([make() for make in factories])
