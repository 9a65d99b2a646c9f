"""Redacting texts and restoring placeholders, for one agent's redaction config and one vault.

``redact`` finds the values in a batch of texts, asks the vault for all their
placeholders in one call and substitutes them. ``restore`` replaces the exact
placeholders the session knows, deep inside a JSON-like value, and reports
what it had to leave as written: a placeholder the session does not know (the
model invented it) and anything that looks like a mangled one (``«EMAIL_1``,
``<EMAIL_1>``, ``email_1``). Those tokens come from the model's own text, which
never held a raw value, so they are safe to log and to publish.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from worker.redaction.detectors import PLACEHOLDER, Detector, Found
from worker.redaction.vault import Vault
from worker.redaction.walk import rebuild, strings

BUILTIN_LABELS: Final = ("EMAIL", "PHONE", "IBAN", "CARD")
MAX_REPORTED: Final = 32


@dataclass(frozen=True, slots=True)
class Restored:
    """A value with the session's placeholders restored."""

    value: Any
    used: dict[str, str] = field(default_factory=dict)
    """Placeholder → value, for each placeholder that was restored."""
    unresolved: tuple[str, ...] = ()
    """Placeholder-like tokens left as written (unknown to the session, or mangled)."""


class Redactor:
    def __init__(
        self, detector: Detector, vault: Vault, *, ttl_s: int, labels: Iterable[str] = ()
    ) -> None:
        self.detector = detector
        self.vault = vault
        self.ttl_s = ttl_s
        names = sorted({*BUILTIN_LABELS, *labels}, key=len, reverse=True)
        self.suspect = re.compile(
            r"«[^«»\n]{0,40}»?|(?<![A-Za-z0-9_])(?:"
            + "|".join(re.escape(n) for n in names)
            + r")_[0-9]+»?|»",
            re.IGNORECASE,
        )

    async def redact(
        self, session_id: str, texts: Sequence[str], known: Mapping[str, str] | None = None
    ) -> list[str]:
        """``texts`` with every value replaced by the session's placeholder for it.

        ``known`` (value → placeholder) is replaced first, verbatim: values this
        step restored for a tool, which its output may echo in any context.
        """
        if known:
            texts = [_replace_known(text, known) for text in texts]
        founds = [self.detector.find(text) for text in texts]
        distinct: dict[tuple[str, str], str] = {}
        for text, found in zip(texts, founds, strict=True):
            for f in found:
                distinct.setdefault((f.label, f.key), text[f.start : f.end])
        if not distinct:
            return list(texts)
        items = [(label, key, value) for (label, key), value in distinct.items()]
        placeholders = await self.vault.assign(session_id, items, self.ttl_s)
        mapping = dict(zip(distinct, placeholders, strict=True))
        return [_substitute(t, found, mapping) for t, found in zip(texts, founds, strict=True)]

    async def restore(self, session_id: str, value: Any) -> Restored:
        """``value`` (a string or JSON-like data) with the session's placeholders restored."""
        texts = strings(value)
        wanted = sorted({m.group(0) for t in texts if "«" in t for m in PLACEHOLDER.finditer(t)})
        mangled = [
            token[:64]
            for t in texts
            for token in self.suspect.findall(PLACEHOLDER.sub(" ", t) if "«" in t else t)
        ]
        resolved = await self.vault.resolve(session_id, wanted) if wanted else {}
        if resolved:

            def swap(m: re.Match[str]) -> str:
                return resolved.get(m.group(0), m.group(0))

            texts = [PLACEHOLDER.sub(swap, t) if "«" in t else t for t in texts]
            value = rebuild(value, iter(texts))
        unknown = [p for p in wanted if p not in resolved]
        unresolved = tuple(dict.fromkeys([*unknown, *mangled]))[:MAX_REPORTED]
        return Restored(value, resolved, unresolved)

    async def touch(self, session_id: str) -> None:
        await self.vault.touch(session_id, self.ttl_s)


def _replace_known(text: str, known: Mapping[str, str]) -> str:
    for value in sorted(known, key=len, reverse=True):
        if value in text:
            text = text.replace(value, known[value])
    return text


def _substitute(text: str, found: tuple[Found, ...], mapping: dict[tuple[str, str], str]) -> str:
    if not found:
        return text
    parts: list[str] = []
    pos = 0
    for f in found:
        parts += [text[pos : f.start], mapping[(f.label, f.key)]]
        pos = f.end
    parts.append(text[pos:])
    return "".join(parts)
