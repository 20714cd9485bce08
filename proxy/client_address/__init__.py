"""Where a client connection really comes from: its socket's peer, or the PROXY protocol header a
trusted load balancer sends ahead of the client's bytes."""
