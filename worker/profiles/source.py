"""The agents file as a running worker sees it: the profiles, their hook sets, and reloads.

The worker reloads the file on SIGHUP and when it changes (its modification time and size,
looked at most once a second, when a step asks for a profile). A step that started runs with
the profile it started with; the next one gets the new profile. A file that fails to load —
it does not parse, a profile does not validate, a hook set does not import, a provider is not
configured — is refused as a whole: the profiles before stay, the error is logged and counted
(``loopwire_profile_reload_errors_total``), and ``/readyz`` stays ready. ``loopwire agents
check FILE`` runs the same checks (``check_file``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

from worker.errors import ProfileError
from worker.profiles.agents import AgentProfile, AgentProfiles
from worker.profiles.hooksets import HookSets
from worker.redaction import REDACT
from worker.redaction.config import RedactionConfig
from worker.redaction.service import Redaction

log = logging.getLogger("loopwire.profiles")

CHECK_EVERY_S = 1.0


def check_file(
    path: Path, providers: Iterable[str], redaction: Redaction | None = None
) -> tuple[AgentProfiles, HookSets]:
    """The file's profiles and hook sets, or ``ProfileError`` naming every problem found."""
    from worker.profiles.checking import problems

    found = problems(path, providers, redaction)
    if found:
        raise ProfileError(f"agents file {path}:\n  - " + "\n  - ".join(found))
    try:
        profiles = AgentProfiles.load(path)
        return profiles, HookSets(profiles, redaction)
    except (OSError, ValueError) as exc:  # changed since it was checked
        raise ProfileError(f"agents file {path}: {exc}") from None


class ProfileSource:
    """The profiles and hook sets in use, replaced as a whole when the file reloads."""

    def __init__(
        self,
        profiles: AgentProfiles,
        hook_sets: HookSets,
        *,
        path: Path | None = None,
        providers: Iterable[str] = ("default",),
        redaction: Redaction | None = None,
        on_loaded: Callable[[AgentProfiles], None] = lambda _: None,
        on_error: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.profiles = profiles
        self.hook_sets = hook_sets
        self.path = path
        self.providers = tuple(providers)
        self.redaction = redaction
        self.on_loaded = on_loaded
        self.on_error = on_error
        self.clock = clock
        self._stamp = _stamp(path)
        self._checked = clock()
        on_loaded(profiles)

    def get(self, name: str) -> AgentProfile | None:
        if self.path is not None and self.clock() - self._checked >= CHECK_EVERY_S:
            self._checked = self.clock()
            if _stamp(self.path) != self._stamp:
                self.reload()
        return self.profiles.get(name)

    def reload(self) -> bool:
        """Load the file again; ``False`` (the profiles before stay) when it fails."""
        if self.path is None:
            return False
        self._stamp = _stamp(self.path)
        try:
            profiles, hook_sets = check_file(self.path, self.providers, self.redaction)
        except ProfileError as exc:
            log.error("agents file not reloaded, the profiles before stay: %s", exc)
            self.on_error()
            return False
        self.profiles, self.hook_sets = profiles, hook_sets
        log.info("agents file %s reloaded: %d profile(s)", self.path, len(profiles.agents))
        self.on_loaded(profiles)
        return True

    @property
    def redaction_configs(self) -> Mapping[str, RedactionConfig]:
        """Each agent's redaction configuration, by name, as the profiles say now."""
        return _Configs(self)


class _Configs(Mapping[str, RedactionConfig]):
    """A live view: the configuration of each agent that enables ``redact``."""

    def __init__(self, source: ProfileSource) -> None:
        self.source = source

    def _now(self) -> dict[str, RedactionConfig]:
        return {p.name: p.redaction for p in self.source.profiles.agents if REDACT in p.hooks}

    def __getitem__(self, name: str) -> RedactionConfig:
        return self._now()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._now())

    def __len__(self) -> int:
        return len(self._now())


def _stamp(path: Path | None) -> tuple[int, int] | None:
    if path is None:
        return None
    try:
        found = os.stat(path)
    except OSError:
        return None
    return found.st_mtime_ns, found.st_size
