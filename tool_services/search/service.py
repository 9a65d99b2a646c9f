"""The ``search`` tool: full-text search over the documents in ``docs/`` (see ``index``).

The index is built in memory when the service starts (``create_service``).
The result is ``{"results": [...]}``, an empty list when nothing matches, so the
loop's empty-streak guard can judge it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tool_services.sdk import CallContext, ToolService
from tool_services.search.index import SearchIndex

DOCS_DIR = Path(__file__).parent / "docs"

DESCRIPTION = (
    "Full-text search over the loopwire documentation (configuration, guarantees, retries, "
    "scaling, events, tool services, troubleshooting). Returns the best matching documents "
    "with a snippet each, best first; an empty list when nothing matches."
)


class SearchArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    query: str = Field(min_length=1, max_length=500, description="Words to look for.")
    limit: int = Field(default=5, ge=1, le=20, description="How many results at most.")


def create_service(docs_dir: Path | None = None) -> ToolService:
    """Index ``docs_dir`` (default: the bundled loopwire docs) and serve the ``search`` tool."""
    index = SearchIndex.from_directory(docs_dir or DOCS_DIR)
    service = ToolService("search")

    async def search(args: SearchArgs, ctx: CallContext) -> dict[str, Any]:
        hits = index.search(args.query, args.limit)
        return {
            "results": [
                {"title": h.title, "path": h.path, "snippet": h.snippet, "score": h.score}
                for h in hits
            ]
        }

    service.add_tool(
        search, description=DESCRIPTION, timeout_s=10, idempotent=True, args_model=SearchArgs
    )
    service.on_shutdown(index.close)
    return service
