"""The proxy's view of the real cluster: finding its brokers, whether it answers, topic ids."""
