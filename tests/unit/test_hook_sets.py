"""Hook sets by import path: resolved when the profiles load, refused with the profile and the
hook named."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from tests.hook_fixtures.hooks import FailingAfterTool, StopAt
from worker.errors import ProfileError
from worker.loop import Hooks
from worker.profiles.agents import AgentProfiles
from worker.profiles.hooksets import HookSets

FIXTURES = "tests.hook_fixtures.hooks"


def profiles(**agent: Any) -> AgentProfiles:
    return AgentProfiles.model_validate({"agents": [{"name": "support", **agent}]})


def test_a_hook_class_by_import_path_gets_its_validated_config() -> None:
    sets = HookSets(
        profiles(
            hooks=[f"{FIXTURES}:StopAt"],
            hook_config={f"{FIXTURES}:StopAt": {"point": "after_tool", "step": 2}},
        )
    )
    hook = sets.for_agent("support")
    assert isinstance(hook, StopAt)
    assert hook.config == StopAt.Config(point="after_tool", step=2)
    assert sets.for_agent("support") is not hook  # a fresh hook for every step


def test_several_sets_run_in_the_listed_order() -> None:
    sets = HookSets(
        profiles(
            hooks=[f"{FIXTURES}:FailingAfterTool", f"{FIXTURES}:StopAt"],
            hook_config={f"{FIXTURES}:StopAt": {"point": "prepare_messages"}},
        )
    )
    hook = sets.for_agent("support")
    assert isinstance(hook, Hooks)
    assert [type(h) for h in hook.hooks] == [FailingAfterTool, StopAt]
    assert HookSets(profiles()).for_agent("support").name == "hooks"  # none: the no-op set


@pytest.mark.parametrize(
    ("hooks", "config", "message"),
    [
        (["nope"], {}, "expected a built-in name or 'module:attribute'"),
        (["no_such_module_xyz:Hook"], {}, "cannot import 'no_such_module_xyz'"),
        ([f"{FIXTURES}:Missing"], {}, "has no attribute 'Missing'"),
        ([f"{FIXTURES}:NOT_A_HOOK"], {}, "is not a subclass of worker.loop.hooks.Hook"),
        ([f"{FIXTURES}:StopAt"], {}, "invalid hook_config"),
        (
            [f"{FIXTURES}:StopAt"],
            {f"{FIXTURES}:StopAt": {"point": "someday"}},
            "invalid hook_config",
        ),
        (
            [f"{FIXTURES}:FailingAfterTool"],
            {f"{FIXTURES}:FailingAfterTool": {"x": 1}},
            "declares no Config model",
        ),
    ],
)
def test_a_hook_set_that_does_not_resolve_is_refused_naming_profile_and_hook(
    hooks: list[str], config: dict[str, Any], message: str
) -> None:
    with pytest.raises(ProfileError, match=message) as refused:
        HookSets(profiles(hooks=hooks, hook_config=config))
    assert f"agent 'support', hook set {hooks[0]!r}" in str(refused.value)


def test_config_for_a_hook_set_that_is_not_enabled_is_refused() -> None:
    with pytest.raises(ValidationError, match="not a hook set in 'hooks'"):
        profiles(hook_config={f"{FIXTURES}:StopAt": {"point": "after_tool"}})
