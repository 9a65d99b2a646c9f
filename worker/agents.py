"""Agent profiles: who the agent is (prompt, model, tools) and its loop limits.

Profiles come from a JSON file (``LOOPWIRE_AGENTS_FILE``) the worker loads at
start: ``{"agents": [{"name": ..., "system_prompt": ..., ...}]}``. A turn names its
agent; a turn may override the limits only within the contract's bounds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from contracts.base import Contract
from worker.loop.output import check_schema
from worker.loop.spec import AgentSpec
from worker.redaction import REDACT
from worker.redaction.config import RedactionConfig


class AgentProfile(AgentSpec):
    """An agent as the agents file declares it: the loop's ``AgentSpec`` plus the hook sets to
    enable and their configuration."""

    hooks: tuple[str, ...] = Field(
        default=(),
        description="Hook sets to enable, in order: built-in names ('redact') or import paths "
        "('mypkg.guards:NoRefunds', a worker.loop.hooks.Hook subclass); see docs/hooks.md.",
    )
    hook_config: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="Configuration of hook sets given by import path, by their name in 'hooks'; "
        "validated by the hook's own Config model.",
    )
    redaction: RedactionConfig = Field(
        default_factory=RedactionConfig,
        description="Configuration of the 'redact' hook set (worker.redaction).",
    )

    def model_post_init(self, context: Any, /) -> None:
        """Keeps ``model_fields_set`` (which contracts drop): ``_redaction_enabled`` reads it."""

    @model_validator(mode="after")
    def _redaction_enabled(self) -> AgentProfile:
        # A redaction block without the hook set would quietly send raw values to the model.
        if "redaction" in self.model_fields_set and REDACT not in self.hooks:
            raise ValueError(f"'redaction' is configured but {REDACT!r} is not in 'hooks'")
        if self.output_schema is not None:
            check_schema(self.output_schema)  # a ValueError names the problem
        for name in self.hook_config:
            if name not in self.hooks or name == REDACT:
                raise ValueError(
                    f"'hook_config' names {name!r}, which is not a hook set in 'hooks'"
                )
        return self


class AgentProfiles(Contract):
    agents: tuple[AgentProfile, ...]

    def get(self, name: str) -> AgentProfile | None:
        return next((a for a in self.agents if a.name == name), None)

    @classmethod
    def load(cls, path: Path) -> AgentProfiles:
        return cls.model_validate(json.loads(path.read_text(encoding="utf-8")))
