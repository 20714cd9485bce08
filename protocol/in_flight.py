"""The queue of requests awaiting their responses, in the order they were sent.

A Kafka connection answers requests in order. Responses the proxy makes itself (an ApiVersions
refusal, a quota admin answer) wait in the same queue as forwarded requests, so they reach the
client in their turn; Produce with acks=0 gets no response and takes no place in the queue.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .mutation_charge import MutationCharge


@dataclass(slots=True)
class InFlight:
    """A request awaiting its response, or a response the proxy made, waiting for its turn."""

    correlation_id: int
    api_key: int
    api_version: int
    client_id: str | None
    local_response: bytes | None = None
    #: when the request went upstream (the caller's clock, ms)
    sent_ms: float = 0.0
    #: a Fetch's long-poll allowance, not charged as request time
    max_wait_ms: int = 0
    request_bytes: int = 0
    #: throttle already decided when the request arrived (Produce bytes, producer ids)
    throttle_ms: int = 0
    #: a Fetch response already charged when its first bytes arrived (it was over quota, so it
    #: is buffered to be emptied instead of streamed): its throttle
    precharged_ms: int | None = None
    #: a quota admin request the I/O layer is still answering
    awaiting_answer: bool = False
    #: a CreateTopics / CreatePartitions / DeleteTopics charged to the controller mutation quota:
    #: what its answer settles (and the proxy's refusals to merge into it)
    mutation: MutationCharge | None = None
    #: the proxy's own Metadata request for the partition counts of the mutation request with this
    #: correlation id: its answer is not the client's
    lookup_for: int | None = None
    #: the Produce or Fetch holds a slot at its broker (BrokerAdmission's ticket), given back on its answer
    slot: Hashable | None = None


def size_prefix(n: int) -> bytes:
    """A frame's 4-byte size, written as its own chunk so the frame itself is never copied."""
    return n.to_bytes(4, "big")


def take_local_responses(in_flight: deque[InFlight]) -> list[bytes]:
    """The proxy's own responses now at the head of the queue, framed, in order."""
    local: list[bytes] = []
    while in_flight and in_flight[0].local_response is not None:
        response = in_flight.popleft().local_response
        assert response is not None
        local += (size_prefix(len(response)), response)
    return local


__all__ = ["InFlight", "size_prefix", "take_local_responses"]
