"""protocol/broker_admission.py: a connection's side of the concurrency limit."""

from __future__ import annotations

from collections.abc import Hashable

from protocol.broker_admission import AdmissionGate


class Admission:
    """Hands out `free` slots, then makes requests wait; records what is given back."""

    def __init__(self, free: int) -> None:
        self.free = free
        self.returned: list[tuple[Hashable, float | None, bool]] = []

    def admit(self, principal: str, client_id: str) -> Hashable | None:
        if self.free <= 0:
            return None
        self.free -= 1
        return f"{client_id}-{self.free}"

    def done(self, ticket: Hashable, latency_ms: float | None, fetch: bool = False) -> None:
        self.returned.append((ticket, latency_ms, fetch))


def _gate(free: int) -> tuple[AdmissionGate, Admission]:
    admission = Admission(free)
    return AdmissionGate(admission), admission


def test_a_free_slot_is_taken_and_given_back_with_its_latency() -> None:
    gate, admission = _gate(2)
    ticket = gate.take("u", "c")
    assert ticket == "c-1" and not gate.awaiting
    gate.answered(ticket, 12.5)
    assert admission.returned == [("c-1", 12.5, False)]
    fetch = gate.take("u", "c")
    gate.answered(fetch, None)  # a Fetch: untimed, told as one
    assert admission.returned[-1] == (fetch, None, True)


def test_a_request_waits_and_takes_the_slot_granted_to_it() -> None:
    gate, admission = _gate(0)
    assert gate.take("u", "c") is None and gate.awaiting
    assert gate.granted("late")
    assert not gate.awaiting and gate.take("u", "c") == "late", "the granted slot, not a new one"
    assert admission.returned == []


def test_a_slot_granted_to_nobody_goes_back_at_once() -> None:
    gate, admission = _gate(0)
    assert not gate.granted("stray")
    assert admission.returned == [("stray", None, False)]


def test_closing_gives_back_a_granted_slot_not_yet_taken() -> None:
    gate, admission = _gate(0)
    gate.take("u", "c")
    gate.granted("kept")
    assert gate.release() == ["kept"] and not gate.awaiting
    assert gate.release() == []
    gate.give_back("other")
    assert admission.returned == [("other", None, False)]
