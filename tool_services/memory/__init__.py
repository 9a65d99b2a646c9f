"""The ``memory`` tool service: long-term memory beyond the session
(``python -m tool_services.memory``; docs/memory.md)."""

from tool_services.memory.service import create_service

__all__ = ["create_service"]
