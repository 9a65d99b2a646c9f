"""The ``notes`` tool service: file notes for a session (``python -m tool_services.notes``)."""

from tool_services.notes.service import create_service

__all__ = ["create_service"]
