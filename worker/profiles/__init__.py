"""Agent profiles and what configures them: the profiles themselves (``agents``), the hook
sets a profile enables (``hooksets``), the built-in guards (``guards``), and the agents file
read and reloaded while the worker runs (``source``)."""
