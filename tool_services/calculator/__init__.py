"""The ``calculator`` tool service: exact arithmetic (``python -m tool_services.calculator``)."""

from tool_services.calculator.service import create_service

__all__ = ["create_service"]
