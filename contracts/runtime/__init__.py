"""What every loopwire process runs beside its work: the health/metrics HTTP server and build info."""
