"""Agent profiles: who the agent is (prompt, model, tools) and its loop limits.

Profiles come from a JSON file (``LOOPWIRE_AGENTS_FILE``) the worker loads at
start: ``{"agents": [{"name": ..., "system_prompt": ..., ...}]}``. A turn names its
agent; a turn may override the limits only within the contract's bounds.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import Field

from contracts.base import AgentName, Contract
from contracts.turns import LoopLimits


class AgentProfile(Contract):
    name: AgentName
    system_prompt: str | None = None
    model: str | None = Field(default=None, description="Overrides the worker's default model.")
    temperature: float | None = Field(default=None, ge=0, le=2)
    max_tokens: int | None = Field(default=None, ge=1)
    tools: tuple[str, ...] = Field(
        default=("*",), description="Tool names the agent may use; '*' allows every announced tool."
    )
    limits: LoopLimits = LoopLimits()
    hooks: tuple[str, ...] = Field(default=(), description="Names of built-in hook sets to enable.")

    def allows(self, tool: str) -> bool:
        return "*" in self.tools or tool in self.tools


class AgentProfiles(Contract):
    agents: tuple[AgentProfile, ...]

    def get(self, name: str) -> AgentProfile | None:
        return next((a for a in self.agents if a.name == name), None)

    @classmethod
    def load(cls, path: Path) -> AgentProfiles:
        return cls.model_validate(json.loads(path.read_text(encoding="utf-8")))
