"""Cluster capacity at run time: the brokers' health as responses show it, and the loop that
shares the capacity (the arithmetic is quotas/capacity.py and quotas/adaptive_capacity.py)."""
