"""The runtime: listeners and client connections (`server`, `session`), and the concerns they call,
one sub-package each (limits, client_address, upstream, fleet, capacity, observability, admin,
supervisor). It moves bytes and asks the pure packages (`protocol/`, `quotas/`) what to do."""
