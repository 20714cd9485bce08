"""What the proxy holds for a client, bounded: connections (per IP, in all) and queued request bytes."""
