"""Tool services the integration tests run as subprocesses."""
