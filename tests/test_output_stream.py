"""The stream accumulator: engine deltas in, events and whole outputs out (no model)."""

from pagedserve.output_stream import RequestStream
from pagedserve.outputs import CompletionDelta, RequestDelta, RequestMetrics, Usage


def delta(index, text, ids, finish=None, stop=None, logprobs=None):
    return CompletionDelta(index, text, ids, logprobs, finish, stop)


def test_updates_give_events_and_totals():
    s = RequestStream("r", [1, 2, 3], n=2, prompt="abc")
    events = s.update([RequestDelta("r", [delta(0, "He", [10]), delta(1, "", [20])])])
    assert [(e.index, e.text, e.token_ids) for e in events] == [(0, "He", [10]), (1, "", [20])]
    s.update([RequestDelta("r", [delta(0, "llo", [11], "stop", "!")])])
    assert s.events == [delta(0, "llo", [11], "stop", "!")]
    metrics = RequestMetrics(arrival_time=1.0)
    s.update([RequestDelta("r", [delta(1, "Yo", [21], "length")], True, metrics)])
    assert s.finished and s.metrics is metrics
    out = s.output()
    assert (out.request_id, out.prompt, out.prompt_token_ids) == ("r", "abc", [1, 2, 3])
    assert [(o.text, o.token_ids, o.finish_reason, o.stop_reason) for o in out.outputs] == [
        ("Hello", [10, 11], "stop", "!"),
        ("Yo", [20, 21], "length", None),
    ]
    assert s.usage == Usage(3, 4) and s.usage.total_tokens == 7


def test_deltas_that_piled_up_merge_into_one_event_per_completion_in_index_order():
    s = RequestStream("r", [1], n=2, logprobs=True)
    events = s.update(
        [
            RequestDelta("r", [delta(1, "a", [5], logprobs=[{5: -0.1}])]),
            RequestDelta("r", [delta(0, "x", [7], logprobs=[{7: -0.2}])]),
            RequestDelta("r", [delta(1, "b", [6], "stop", logprobs=[{6: -0.3}])]),
        ]
    )
    assert [(e.index, e.text, e.token_ids, e.logprobs, e.finish_reason) for e in events] == [
        (0, "x", [7], [{7: -0.2}], None),
        (1, "ab", [5, 6], [{5: -0.1}, {6: -0.3}], "stop"),
    ]
    assert s.outputs[1].logprobs == [{5: -0.1}, {6: -0.3}]
    # Merging did not touch the deltas themselves.
    assert s.outputs[1].token_ids == [5, 6] and s.outputs[1].text == "ab"


def test_abort_ends_only_unfinished_completions_and_later_deltas_are_ignored():
    s = RequestStream("r", [1, 2], n=2)
    s.update([RequestDelta("r", [delta(0, "done", [3], "stop"), delta(1, "par", [4])])])
    events = s.abort()
    assert [(e.index, e.finish_reason) for e in events] == [(1, "abort")]
    assert s.finished
    assert [o.finish_reason for o in s.output().outputs] == ["stop", "abort"]
    assert s.update([RequestDelta("r", [delta(1, "late", [9])])]) == []
    assert s.outputs[1].text == "par"


def test_an_output_processor_sees_every_delta_before_it_is_recorded():
    class Upper:
        def __init__(self, index: int):
            self.index, self.seen = index, []

        def process(self, d: CompletionDelta) -> CompletionDelta:
            self.seen.append(d.text)
            return CompletionDelta(d.index, d.text.upper(), d.token_ids, d.logprobs,
                                   d.finish_reason, d.stop_reason)  # fmt: skip

    made = []

    def factory(i):
        made.append(Upper(i))
        return made[-1]

    s = RequestStream("r", [1], n=1, processor=factory)
    events = s.update(
        [RequestDelta("r", [delta(0, "ab", [1])]), RequestDelta("r", [delta(0, "c", [2])])]
    )
    assert [e.text for e in events] == ["ABC"]
    assert s.outputs[0].text == "ABC" and made[0].seen == ["ab", "c"]
