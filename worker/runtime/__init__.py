"""The worker process's runtime around the loop: Prometheus metrics (``metrics``),
OpenTelemetry spans (``tracing``), the C heap's trimming (``heap``), the cyclic garbage
collector's tuning (``collector``) and the failpoints crash tests use (``failpoints``)."""
