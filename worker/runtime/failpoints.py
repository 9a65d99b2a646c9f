"""Failpoints for crash testing.

``LOOPWIRE_FAILPOINTS=name[,name…]`` makes the process die (``os._exit(137)``,
as if SIGKILLed) when it reaches a named point; ``raise-<name>`` makes it raise
``FailpointError`` there instead, every time (a step that can never succeed).

Points: ``step_begin`` (a step message was taken, its lease held),
``model_saved`` (the model's answer was saved, no tool dispatched yet),
``tool_dispatched`` (a tool call was published), ``step_recorded`` (a step's record was
appended to its turn's step list, with the save of the state that counts it: one script, so
no worker dies between the two; nothing of the step announced or published yet), ``tool_result_saved`` (a tool
result was saved), ``step_saved`` (a step was saved, the next step's message not
published yet), ``before_ack`` (everything of a step was saved and published,
the work message not acked yet), ``cancel_recorded`` (a ``turn.cancel`` was
recorded, not applied yet), ``decision_recorded`` (likewise a ``turn.decision``),
``child_result_recorded`` (likewise a ``turn.child_result``), ``summary_saved`` (a context
summary was made and saved, the step's model call not made yet),
``parked`` (a turn was saved parked, nothing announced or sent yet), ``resumed``
(a parked turn was saved going on, its tools not run yet), ``tenant_slot_released`` (an
ended turn gave its tenant's slot to a turn in line, whose first step is not sent yet). Unset in production: then ``hit`` is a no-op.
"""

from __future__ import annotations

import os
import sys

from worker.errors import FailpointError

_ARMED = frozenset(filter(None, os.environ.get("LOOPWIRE_FAILPOINTS", "").split(",")))


def hit(point: str) -> None:
    if not _ARMED:
        return
    if point in _ARMED:
        sys.stderr.write(f"failpoint {point}: exiting\n")
        sys.stderr.flush()
        os._exit(137)
    if f"raise-{point}" in _ARMED:
        raise FailpointError(f"failpoint {point}")
