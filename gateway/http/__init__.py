"""The HTTP front door: threads, runs and streams in the Agent Protocol's shape over the fleet
(docs/http.md). ``loopwire gateway serve`` runs it (``worker.cli.gateway``)."""
