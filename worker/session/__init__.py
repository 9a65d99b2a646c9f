"""The session store in Redis: states, histories, turn queues, leases, and the port the worker uses."""
