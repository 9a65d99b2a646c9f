"""The ``search`` tool service: full-text search over loopwire's docs (``python -m tool_services.search``)."""

from tool_services.search.service import create_service

__all__ = ["create_service"]
