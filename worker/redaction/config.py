r"""The ``redaction`` block of an agent profile (used when the profile enables ``"redact"``).

Example::

    {"name": "support", "hooks": ["redact"],
     "redaction": {"detect": ["email", "phone", "iban", "card"],
                   "patterns": {"CUSTOMER_ID": "\\bCUST-\\d{8}\\b"},
                   "literals": {"CODENAME": ["Project Falcon"]},
                   "restore_answer": true}}

Labels name the placeholders (``«CUSTOMER_ID_1»``), so they are upper-case
identifiers. Every pattern is compiled when the profile is loaded: a bad one
stops the worker at start, not in the middle of a turn.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, StringConstraints, field_validator

from contracts.base import Contract

BuiltinKind = Literal["email", "phone", "iban", "card"]
Label = Annotated[str, StringConstraints(pattern=r"^[A-Z][A-Z0-9_]{0,31}$")]
Literal_ = Annotated[str, StringConstraints(min_length=2, max_length=256)]


class RedactionConfig(Contract):
    """What the ``redact`` hook set detects, and whether the publisher gets real values back."""

    detect: tuple[BuiltinKind, ...] = Field(
        default=("email", "phone", "iban", "card"),
        description="Built-in detectors: e-mail, phone, IBAN (mod-97), payment card (Luhn).",
    )
    patterns: dict[Label, Annotated[str, StringConstraints(min_length=1, max_length=1000)]] = Field(
        default_factory=dict, max_length=64, description="Label -> regular expression."
    )
    literals: dict[Label, tuple[Literal_, ...]] = Field(
        default_factory=dict,
        max_length=64,
        description="Label -> exact values (matched case-insensitively, on word boundaries).",
    )
    restore_answer: bool = Field(
        default=True,
        description="Restore placeholders in the final answer sent to the publisher "
        "(the stored result and the turn.completed event always keep them).",
    )
    ttl_s: int | None = Field(
        default=None,
        ge=60,
        description="Lifetime of the session's mapping, refreshed on use; "
        "default: the worker's state TTL.",
    )

    @field_validator("patterns")
    @classmethod
    def _patterns_compile(cls, patterns: dict[str, str]) -> dict[str, str]:
        for label, pattern in patterns.items():
            try:
                compiled = re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"pattern {label}: {exc}") from None
            if compiled.fullmatch(""):
                raise ValueError(f"pattern {label} matches the empty string")
        return patterns
