"""Connection limits (max.connections, max.connections.per.ip) and the descriptor arithmetic."""

from __future__ import annotations

from proxy.limits.admission import (
    DESCRIPTORS_PER_CONNECTION,
    RESERVED_DESCRIPTORS,
    ConnectionLimits,
    connections_for_descriptors,
)


def test_total_limit_refuses_past_it_and_frees_on_release() -> None:
    limits = ConnectionLimits(2)
    assert limits.admit("10.0.0.1") is None
    assert limits.admit("10.0.0.2") is None
    assert limits.admit("10.0.0.3") == "max_connections = 2 reached"
    limits.release("10.0.0.1")
    assert limits.admit("10.0.0.3") is None
    assert limits.total == 2


def test_per_ip_limit_counts_each_address_alone() -> None:
    limits = ConnectionLimits(10, max_connections_per_ip=2)
    assert limits.admit("a") is None and limits.admit("a") is None
    assert limits.admit("a") == "max_connections_per_ip = 2 reached for a"
    assert limits.admit("b") is None
    assert limits.total == 3  # the refused one was not counted
    limits.release("a")
    limits.release("a")
    assert "a" not in limits.per_ip
    assert limits.admit("a") is None


def test_connections_fit_the_descriptor_limit() -> None:
    assert connections_for_descriptors(1024) == (1024 - RESERVED_DESCRIPTORS) // DESCRIPTORS_PER_CONNECTION
    assert connections_for_descriptors(10) == 1
