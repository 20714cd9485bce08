"""`kthrottle run --workers N`: the parent that starts, restarts and stops the worker processes sharing
the listeners (SO_REUSEPORT), and what a worker learns from it. Not the fleet exchange: the workers
join a fleet (`proxy/fleet/`) like proxies on several hosts do."""
