"""What operators watch: Prometheus metrics, the HTTP endpoint (/metrics, /ready), usage events, and
the log summaries."""
