"""The fleet's group protocol (protocol/fleet_group.py): metadata in, the same member list out."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol.fleet_group import (
    MAX_METADATA_BYTES,
    Assignment,
    FleetGroupError,
    Member,
    MemberMetadata,
    assign,
)

hosts = st.from_regex(r"[a-z0-9.:-]{1,40}", fullmatch=True)
ports = st.integers(1, 65535)
offsets = st.integers(-1, 2**63 - 1)


@given(hosts, ports, offsets)
def test_metadata_round_trips(host: str, port: int, offset: int) -> None:
    metadata = MemberMetadata(host, port, offset)
    assert MemberMetadata.decode(metadata.encode()) == metadata


@given(st.lists(st.tuples(st.text(min_size=1, max_size=20), hosts, ports, offsets),
                min_size=1, max_size=20, unique_by=lambda row: row[0]))
def test_every_member_gets_the_same_whole_list_and_the_furthest_offset(
        rows: list[tuple[str, str, int, int]]) -> None:
    joined = [(member_id, MemberMetadata(host, port, offset).encode())
              for member_id, host, port, offset in rows]
    assignments, left_out = assign(7, rows[0][0], joined)
    assert left_out == []
    assert set(assignments) == {row[0] for row in rows}
    assert len(set(assignments.values())) == 1
    decoded = Assignment.decode(next(iter(assignments.values())))
    assert decoded.generation == 7 and decoded.leader == rows[0][0]
    assert sorted(decoded.members, key=lambda m: m.member_id) == sorted(
        (Member(member_id, host, port) for member_id, host, port, _ in rows), key=lambda m: m.member_id)
    assert decoded.quota_offset == max(row[3] for row in rows)


def test_a_member_with_foreign_metadata_is_left_out_and_named() -> None:
    good = MemberMetadata("127.0.0.2", 7400, 12).encode()
    assignments, left_out = assign(1, "a", [("a", good), ("b", b"\x00\x01consumer-protocol")])
    assert len(left_out) == 1 and "'b'" in left_out[0] and "not a JSON document" in left_out[0]
    decoded = Assignment.decode(assignments["b"])  # b still learns the list, without itself
    assert decoded.members == (Member("a", "127.0.0.2", 7400),)


@pytest.mark.parametrize(("data", "named"), [
    (b"x" * (MAX_METADATA_BYTES + 1), "above the limit"),
    (b"[1,2]", "not an object"),
    (b'{"version":2,"host":"h","port":1,"quota_offset":0}', "version 2"),
    (b'{"version":1,"host":"h","port":0,"quota_offset":0}', "outside 1..65535"),
    (b'{"version":1,"host":"h","port":true,"quota_offset":0}', "not an address"),
    (b'{"version":1,"host":"","port":9,"quota_offset":0}', "not a host"),
    (b'{"version":1,"host":"h","port":9,"quota_offset":-2}', "not an offset"),
])
def test_bad_metadata_names_what_was_wrong(data: bytes, named: str) -> None:
    with pytest.raises(FleetGroupError, match=named):
        MemberMetadata.decode(data)


@given(st.binary(max_size=200))
def test_any_bytes_decode_or_raise_fleet_group_error_only(data: bytes) -> None:
    for decode in (MemberMetadata.decode, Assignment.decode):
        with contextlib.suppress(FleetGroupError):  # anything else fails the test
            decode(data)
