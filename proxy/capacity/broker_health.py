"""The brokers' health as the proxy's own traffic shows it: the signal adaptive capacity follows.

Each client session gets an observer bound to the broker its port stands for; its connection
calls it for every Produce response and every Fetch response that carried records (a Fetch that
waited out its max_wait_ms says nothing about the broker). Bootstrap connections, which reach
whichever broker the rotation picked, are filed under BOOTSTRAP_NODE.
"""

from __future__ import annotations

from protocol.connection import HealthObserver
from quotas.adaptive_capacity import AdaptiveCapacity
from quotas.capacity import CapacityManager

#: The "broker" of a bootstrap connection.
BOOTSTRAP_NODE = -1


class BrokerHealth:
    """Feeds responses into the adaptive controller in force, per broker and tenant (none: dropped;
    the controller may come and go while the proxy runs, see live.py). The tenant is the
    capacity's (its `share` entity), so one tenant's many client ids count as one."""

    def __init__(self, controller: AdaptiveCapacity | None, capacity: CapacityManager) -> None:
        self.controller = controller
        self.capacity = capacity

    def observer(self, node_id: int | None) -> HealthObserver:
        """What a session bound to `node_id` hands its connection."""
        broker = BOOTSTRAP_NODE if node_id is None else node_id

        def health(api_key: int, latency_ms: float, errors: list[int], principal: str,
                   client_id: str) -> None:
            controller = self.controller
            if controller is not None:
                tenant = self.capacity.tenant(principal, client_id)[0]
                controller.observe(broker, api_key, latency_ms, errors, tenant)

        return health

    def unreachable(self, node_id: int) -> None:
        """The proxy's own connection to `node_id` failed (refused, timed out): the broker is away."""
        controller = self.controller
        if controller is not None:
            controller.observe_unreachable(node_id)
