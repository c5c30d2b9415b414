"""--draft-schedule: drafts per round by batch size."""
from __future__ import annotations

import pytest

from verispec.engine.draft_schedule import DraftSchedule
from verispec.errors import VerispecError


def test_parsed_steps_pick_the_largest_threshold_at_or_below_the_batch():
    s = DraftSchedule.parse("1:3,8:1,32:0", 3)
    assert [s.drafts_for(b) for b in (1, 7, 8, 31, 32, 100)] == [3, 3, 1, 1, 0, 0]
    assert s.describe() == "1:3,8:1,32:0"


def test_drafts_never_exceed_the_proposers_and_batch_one_is_implied():
    s = DraftSchedule.parse("4:9", 2)
    assert [s.drafts_for(b) for b in (1, 3, 4)] == [2, 2, 2]
    assert DraftSchedule.parse("2:0", 3).drafts_for(1) == 3


def test_without_a_proposer_nothing_is_drafted():
    assert DraftSchedule.parse("1:3", 0).drafts_for(1) == 0


def test_no_schedule_drafts_nothing():
    assert DraftSchedule.parse(None, 3).drafts_for(1) == 0


@pytest.mark.parametrize("bad", ["x", "1:", "1:2:3", "0:1", "2:-1"])
def test_bad_schedules_are_refused_naming_the_entry(bad):
    with pytest.raises(VerispecError, match="--draft-schedule"):
        DraftSchedule.parse(bad, 3)


def test_merged_chunks_say_what_both_said():
    from verispec.engine.types import FinishReason, GenerationChunk, TokenLogprob, merge_chunks

    a = GenerationChunk([1, 2], "ab", [TokenLogprob(1, -0.1), TokenLogprob(2, -0.2)], None, None, 1)
    b = GenerationChunk([3], "c", [TokenLogprob(3, -0.3)], FinishReason.STOP, None, 0)
    m = merge_chunks(a, b)
    assert (m.token_ids, m.text, [lp.token_id for lp in m.logprobs], m.finish_reason, m.num_drafted) == \
        ([1, 2, 3], "abc", [1, 2, 3], FinishReason.STOP, 1)
    assert merge_chunks(GenerationChunk([1], "a"), GenerationChunk([2], "b")).logprobs is None


@pytest.mark.parametrize("field, value", [("repetition_penalty", 1e-300), ("repetition_penalty", 1e300),
                                          ("seed", 2**64), ("seed", -(2**63) - 1)])
def test_sampling_params_refuse_what_would_fail_an_engine_step(field, value):
    """The Python API checks what the server checks: a value that would fail inside a batched step
    (and with it every sequence in the batch) is refused up front, naming the field."""
    from verispec.sampling.params import SamplingParams
    from verispec.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**{field: value})


def test_a_bad_schedule_is_refused_without_a_drafter_too():
    with pytest.raises(VerispecError, match="--draft-schedule"):
        DraftSchedule.parse("1:x", 0)
