"""Several proxies (or `--workers` processes) holding one quota: the usage exchange, who is in the
fleet, and starting it. The `--workers` supervisor is `proxy/supervisor/`."""
