"""Detectors: where the values to redact are in a text, their label and their identity.

Each built-in detector is a candidate pattern plus a check, so that ordinary
numbers (order ids, dates, amounts, timestamps) are left alone:

- ``email``: ``local@domain.tld``; the identity ignores case.
- ``phone``: international (``+`` or ``00``, 8–15 digits), North-American
  (``(555) 123-4567``, ``555-123-4567``) and national with a trunk ``0``
  (``030 1234567``; 10–12 digits when written without separators). A bare run
  of digits is not a phone number: it is as likely an order id.
- ``iban``: country code, check digits, the country's exact length, then the
  ISO 13616 mod-97 check.
- ``card``: 13–19 digits (spaces or dashes allowed) with a card brand's prefix
  and length, then the Luhn check.

Profiles add patterns (the whole match is the value) and literals (matched
ignoring case, on word boundaries). Where matches overlap the earliest wins,
then the longest, then literals, patterns, IBAN, e-mail, card, phone in that
order. Text that already is a placeholder is never matched again.

Speed: the history is scanned before every model call, so the number rules
only look near clusters of digits and the e-mail rule starts at an ``@``;
a text without digits or ``@`` costs two scans.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Final

from worker.redaction.checks import IBAN_LENGTHS, card_valid, iban_valid
from worker.redaction.config import RedactionConfig

PLACEHOLDER: Final = re.compile(r"«[A-Z][A-Z0-9_]*_[0-9]+»")
"""An exact placeholder as the ``redact`` hook set writes it: ``«EMAIL_1»``."""


@dataclass(frozen=True, slots=True)
class Found:
    """A value at ``text[start:end]``; the same ``(label, key)`` always gets the same placeholder."""

    start: int
    end: int
    label: str
    key: str
    rank: int


Check = Callable[[re.Match[str]], tuple[int, int, str] | None]
"""Accepts a candidate: the value's start, end and identity; or ``None``."""


@dataclass(frozen=True, slots=True)
class Rule:
    label: str
    pattern: re.Pattern[str]
    check: Check
    rank: int


def _free(text: str, i: int, extra: str = "") -> bool:
    """Nothing that continues a word (or one of ``extra``) touches position ``i`` from the left."""
    if i == 0:
        return True
    ch = text[i - 1]
    return not (ch.isalnum() or ch == "_" or ch in extra)


_DIGITS: Final = re.compile(r"[0-9]+")
_NON_DIGIT: Final = re.compile(r"[^0-9]")


def _card(m: re.Match[str]) -> tuple[int, int, str] | None:
    if not _free(m.string, m.start(), "+-.,"):
        return None
    value = m.group(0)
    # Longest first, every prefix that ends at a group boundary: "4111 1111 1111 1111 12".
    for group in reversed(list(_DIGITS.finditer(value))):
        digits = _NON_DIGIT.sub("", value[: group.end()])
        if card_valid(digits):
            return m.start(), m.start() + group.end(), digits
    return None


def _iban(m: re.Match[str]) -> tuple[int, int, str] | None:
    text = m.string
    length = IBAN_LENGTHS.get(m.group(1).upper())
    if length is None or not _free(text, m.start()):
        return None
    chars: list[str] = []
    pos = m.start()
    while pos < m.end() and len(chars) < length:
        if text[pos] != " ":
            chars.append(text[pos])
        pos += 1
    if len(chars) < length or (pos < len(text) and text[pos].isalnum()):
        return None  # too short, or the country's length ends inside a word
    compact = "".join(chars).upper()
    return (m.start(), pos, compact) if iban_valid(compact) else None


def _phone(least: int, bare_least: int, before: str) -> Check:
    def check(m: re.Match[str]) -> tuple[int, int, str] | None:
        if not _free(m.string, m.start(), before):
            return None
        value = m.group(0)
        digits = _NON_DIGIT.sub("", value)
        international = value.startswith(("+", "00"))
        if value.startswith("00"):
            digits = digits[2:]
        if not (bare_least if value.isdigit() else least) <= len(digits) <= 15:
            return None
        return m.start(), m.end(), ("+" if international else "") + digits

    return check


def _email(m: re.Match[str]) -> tuple[int, int, str] | None:
    """``m`` matched ``@domain.tld``; the local part is read backwards from the ``@``."""
    text, start = m.string, m.start()
    while start > 0 and (text[start - 1].isalnum() or text[start - 1] in "_.%+-"):
        start -= 1
    while start < m.start() and text[start] == ".":
        start += 1
    if start == m.start():
        return None
    return start, m.end(), text[start : m.end()].lower()


def _whole(m: re.Match[str]) -> tuple[int, int, str] | None:
    return (m.start(), m.end(), m.group(0)) if m.end() > m.start() else None


_END: Final = r"(?![\w]|[.,\-/][0-9])"  # not followed by more of a word or of a number
_EMAIL: Final = re.compile(
    r"@[^\W_](?:[\w\-]*[^\W_])?(?:\.[^\W_](?:[\w\-]*[^\W_])?)*\.[A-Za-z]{2,63}(?![\w\-])"
)
_IBAN: Final = re.compile(r"([A-Za-z]{2})[0-9]{2}(?: ?[A-Za-z0-9]){10,40}")
_CARD: Final = re.compile(r"[0-9](?:[ \-]?[0-9]){12,18}" + _END)
_PHONE_INTL: Final = re.compile(r"(?:\+|00)[1-9](?:[ \-./]?(?:\([0-9]{1,4}\)|[0-9])){6,16}" + _END)
_PHONE_NANP: Final = re.compile(
    r"(?:1[ \-.]?)?(?:\([2-9][0-9]{2}\) ?|[2-9][0-9]{2}[ \-.])[0-9]{3}[ \-.][0-9]{4}" + _END
)
_PHONE_NATIONAL: Final = re.compile(
    r"(?:\(0[1-9][0-9]{0,4}\) ?|0[1-9][0-9]{0,4}[ \-/]?)[0-9]{3,8}(?:[ \-][0-9]{2,6}){0,3}" + _END
)

_NUMBER_RULES: Final[dict[str, tuple[Rule, ...]]] = {
    "iban": (Rule("IBAN", _IBAN, _iban, 2),),
    "card": (Rule("CARD", _CARD, _card, 4),),
    "phone": (
        Rule("PHONE", _PHONE_INTL, _phone(8, 8, "+"), 5),
        Rule("PHONE", _PHONE_NANP, _phone(10, 10, "+-./"), 5),
        Rule("PHONE", _PHONE_NATIONAL, _phone(7, 10, "+-./,"), 5),
    ),
}
_EMAIL_RULE: Final = Rule("EMAIL", _EMAIL, _email, 3)

# The number rules only run near a cluster: a digit, five digits or separators, a digit.
_CLUSTER: Final = re.compile(r"[0-9][0-9 ()\-./]{5,}[0-9]")
_MARGIN: Final = 16  # how far from its cluster a value may reach (an IBAN's letters, a "+")
# A window ends at a character no number rule matches or looks ahead at differently.
_WINDOW_END: Final = re.compile(r"[\s\"'<>\[\]{};:=&|!?*]")


def _windows(text: str) -> list[tuple[int, int]]:
    windows: list[tuple[int, int]] = []
    for cluster in _CLUSTER.finditer(text):
        lo = max(0, cluster.start() - _MARGIN)
        end = _WINDOW_END.search(text, min(len(text), cluster.end() + _MARGIN))
        hi = end.start() if end is not None else len(text)
        if windows and lo <= windows[-1][1]:
            windows[-1] = (windows[-1][0], max(hi, windows[-1][1]))
        else:
            windows.append((lo, hi))
    return windows


def _scan(rule: Rule, text: str, lo: int, hi: int) -> Iterator[Found]:
    pos = lo
    while (m := rule.pattern.search(text, pos, hi)) is not None:
        hit = rule.check(m)
        if hit is None or hit[1] <= hit[0]:
            pos = m.start() + 1
            continue
        start, end, key = hit
        yield Found(start, end, rule.label, key, rule.rank)
        pos = end


class _Literals:
    """Configured values, found ignoring case and only as whole words."""

    def __init__(self, literals: dict[str, tuple[str, ...]]) -> None:
        self.items = [
            (label, value.lower()) for label, values in literals.items() for value in values
        ]

    def find(self, text: str) -> Iterator[Found]:
        lowered = text.lower()
        if len(lowered) != len(text):  # a rare character whose lower case is longer
            yield from self._find_slow(text)
            return
        for label, needle in self.items:
            i = lowered.find(needle)
            while i >= 0:
                end = i + len(needle)
                if _whole_word(text, i, end):
                    yield Found(i, end, label, needle.casefold(), 0)
                i = lowered.find(needle, i + 1)

    def _find_slow(self, text: str) -> Iterator[Found]:
        for label, needle in self.items:
            for m in re.finditer(re.escape(needle), text, re.IGNORECASE):
                if _whole_word(text, m.start(), m.end()):
                    yield Found(m.start(), m.end(), label, needle.casefold(), 0)


def _whole_word(text: str, start: int, end: int) -> bool:
    def word(ch: str) -> bool:
        return ch.isalnum() or ch == "_"

    head_ok = not word(text[start]) or _free(text, start)
    tail_ok = not word(text[end - 1]) or end == len(text) or not word(text[end])
    return head_ok and tail_ok


_CACHE_MIN_CHARS: Final = 32
_CACHE_MAX_CHARS: Final = 4_000_000
"""Per detector (one per agent profile), counting 128 characters of overhead per entry."""
_ENTRY: Final = 128


class Detector:
    """Finds every value a ``RedactionConfig`` asks to redact.

    Results are cached (least recently used, bounded by the texts' total size):
    the history a worker scans before each model call is mostly the messages it
    scanned for the session's previous steps.
    """

    def __init__(self, config: RedactionConfig) -> None:
        self._cache: OrderedDict[str, tuple[Found, ...]] = OrderedDict()
        self._cached_chars = 0
        self.literals = _Literals(config.literals)
        self.patterns = tuple(
            Rule(label, re.compile(pattern), _whole, 1)
            for label, pattern in config.patterns.items()
        )
        kinds = dict.fromkeys(config.detect)
        self.email = "email" in kinds
        self.numbers = tuple(rule for kind in kinds for rule in _NUMBER_RULES.get(kind, ()))

    def find(self, text: str) -> tuple[Found, ...]:
        """Non-overlapping values in ``text``, in order."""
        if len(text) < _CACHE_MIN_CHARS:
            return self._find(text)
        cached = self._cache.get(text)
        if cached is not None:
            self._cache.move_to_end(text)
            return cached
        found = self._find(text)
        if len(text) <= _CACHE_MAX_CHARS // 8:
            self._cache[text] = found
            self._cached_chars += len(text) + _ENTRY
            while self._cached_chars > _CACHE_MAX_CHARS:
                evicted, _ = self._cache.popitem(last=False)
                self._cached_chars -= len(evicted) + _ENTRY
        return found

    def _find(self, text: str) -> tuple[Found, ...]:
        if not text:
            return ()
        found = list(self.literals.find(text))
        for rule in self.patterns:
            found.extend(_scan(rule, text, 0, len(text)))
        if self.email and "@" in text:
            found.extend(_scan(_EMAIL_RULE, text, 0, len(text)))
        if self.numbers:
            for lo, hi in _windows(text):
                for rule in self.numbers:
                    found.extend(_scan(rule, text, lo, hi))
        return _choose(found, text) if found else ()


def _choose(found: list[Found], text: str) -> tuple[Found, ...]:
    taken = [(p.start(), p.end()) for p in PLACEHOLDER.finditer(text)] if "«" in text else []
    found.sort(key=lambda f: (f.start, f.start - f.end, f.rank))
    out: list[Found] = []
    for f in found:
        if out and f.start < out[-1].end:
            continue
        if any(f.start < end and start < f.end for start, end in taken):
            continue
        out.append(f)
    return tuple(out)
