"""The Produce response error reader against kafka-python's schema-generated encoder."""

from __future__ import annotations

import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kafka.protocol.producer import ProduceResponse

from protocol.errors import MalformedBody
from protocol.skim import produce_response_errors

from .wire import body

PTR = ProduceResponse.TopicProduceResponse
PPR = PTR.PartitionProduceResponse
BATCH_ERROR = PPR.BatchIndexAndErrorMessage
VERSIONS = range(ProduceResponse.min_version, ProduceResponse.max_version + 1)


def produce_body(version: int, topics: list[list[int]]) -> bytes:
    responses = []
    for t, codes in enumerate(topics):
        partitions = [PPR(index=i, error_code=code, base_offset=-1, log_append_time_ms=-1,
                          log_start_offset=-1, error_message="bad" if code else None,
                          record_errors=[BATCH_ERROR(batch_index=0, batch_index_error_message="x")]
                          if code else [])
                      for i, code in enumerate(codes)]
        topic: dict[str, object] = {"partition_responses": partitions}
        if version >= 13:
            topic["topic_id"] = uuid.UUID(int=t + 1)
        else:
            topic["name"] = f"topic-{t}"
        responses.append(PTR(**topic))
    return body(ProduceResponse, version, responses=responses, throttle_time_ms=0)


@pytest.mark.parametrize("version", VERSIONS)
def test_every_version_reads_the_partition_errors_in_order(version: int) -> None:
    frame = produce_body(version, [[0, 7, 0], [19, 6]])
    assert produce_response_errors(frame, 0, version) == [7, 19, 6]


@given(st.sampled_from(list(VERSIONS)),
       st.lists(st.lists(st.sampled_from([0, 0, 0, 6, 7, 19, 20]), max_size=4), max_size=4))
def test_matches_the_encoded_codes(version: int, topics: list[list[int]]) -> None:
    frame = produce_body(version, topics)
    assert produce_response_errors(frame, 0, version) == [c for codes in topics for c in codes if c]


@pytest.mark.parametrize("version", [3, 9, 13])
def test_a_truncated_response_is_refused_by_name(version: int) -> None:
    frame = produce_body(version, [[7, 0]])
    with pytest.raises(MalformedBody, match=f"Produce v{version} response"):
        produce_response_errors(frame[:-12], 0, version)
