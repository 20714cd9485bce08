"""The `kthrottle` command line: `run`, `local-kafka`, `quotas`, `top`, `usage-report`."""
