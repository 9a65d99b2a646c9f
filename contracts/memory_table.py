"""The memory service's table, as the workers also use it: a session's deletion forgets the
session's memories (``tool_services.memory.store`` owns the schema).

Every row belongs to a tenant (its ``tenant`` column, ``default`` for the rows stored before
tenants existed), and every statement names the tenant the task acts for (``tenant()``): with
tenancy off and for the tenant ``default`` that is ``default``, so those rows and results are
what they always were; another tenant's scopes are its own, whatever their owner ids.
"""

from __future__ import annotations

from typing import Final

from contracts import tenancy

TABLE: Final = "lw_memories"
FORGET_SESSION: Final = (
    f"DELETE FROM {TABLE} WHERE scope = 'session' AND owner = $1 AND tenant = $2"
)
"""Forget every memory of one session (``$1``: its id) of one tenant (``$2``); the table may
not exist yet."""
FORGET_SESSION_UNTENANTED: Final = f"DELETE FROM {TABLE} WHERE scope = 'session' AND owner = $1"
"""The same for a table no memory service has given its ``tenant`` column yet: every row of
it is the tenant ``default``'s."""


def tenant() -> str:
    """The tenant whose memories a statement reads or changes: the current one, ``default``
    while tenancy is off."""
    return tenancy.current() or tenancy.DEFAULT
