"""`kthrottle top`: a terminal view of one proxy or a fleet, read from their metrics endpoints. A client
of the proxy, not part of it."""
