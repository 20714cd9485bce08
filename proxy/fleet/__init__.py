"""Several proxies (or `--workers` processes) holding one quota: the usage exchange, who is in the
fleet, starting it, and the worker supervisor."""
