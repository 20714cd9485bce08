"""Where each broker node id really lives, as learned from the cluster's own responses."""

from __future__ import annotations

import logging

from config.common import Address

log = logging.getLogger("kthrottle.proxy")


class BrokerDirectory:
    """Where each broker node id really lives, as learned from responses."""

    def __init__(self) -> None:
        self.addresses: dict[int, Address] = {}

    def learn(self, addresses: dict[int, Address]) -> list[int]:
        """Record addresses; returns the node ids seen for the first time."""
        new = [node for node in addresses if node not in self.addresses]
        for node, address in addresses.items():
            if self.addresses.get(node) != address:
                if node in self.addresses:
                    log.info("broker %d moved from %s:%d to %s:%d", node, *self.addresses[node], *address)
                self.addresses[node] = address
        return new
