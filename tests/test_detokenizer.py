"""Incremental detokenizing and stop strings, on a byte-level toy vocabulary (no model)."""

import pytest

from pagedserve import detokenizer
from pagedserve.sampling_params import SamplingParams
from pagedserve.sequence import Sequence, SequenceStatus

# Token id -> bytes; "é" is two tokens (0xC3 0xA9), as byte-level BPE splits it.
VOCAB = {1: b"Hel", 2: b"lo", 3: b" w", 4: b"orld", 5: b"\xc3", 6: b"\xa9", 7: b"!", 8: b"END"}
VOCAB |= {100 + i: bytes([c]) for i, c in enumerate(b"prompt ")}


def decode(ids: list[int]) -> str:
    return b"".join(VOCAB[i] for i in ids).decode("utf-8", errors="replace")


def make_seq(**params) -> Sequence:
    prompt = [100 + i for i in range(7)]
    seq = Sequence(0, "r", 0, prompt, SamplingParams(**params), max_tokens=64)
    detokenizer.start(seq)
    return seq


def feed(seq: Sequence, ids: list[int]) -> list[tuple[str, str, str | None]]:
    """Per token: (text decoded, text handed out, stop string that fired)."""
    steps = []
    for t in ids:
        seq.output_token_ids.append(t)
        new = detokenizer.append_text(decode, seq)
        stop = detokenizer.find_stop(seq, len(new))
        if stop is not None:
            seq.status = SequenceStatus.FINISHED_STOPPED
        steps.append((new, detokenizer.take_text(seq), stop))
        if stop is not None:
            break
    return steps


def test_text_is_decoded_token_by_token_and_a_split_character_waits_for_its_end():
    seq = make_seq()
    steps = feed(seq, [1, 2, 3, 5, 6, 4])
    assert [new for new, _, _ in steps] == ["Hel", "lo", " w", "", "é", "orld"]
    assert [shown for _, shown, _ in steps] == ["Hel", "lo", " w", "", "é", "orld"]
    assert seq.output_text == decode(seq.output_token_ids) == "Hello wéorld"


def test_a_stop_string_is_cut_and_its_start_never_shown_before_it_is_decided():
    seq = make_seq(stop=["o w"])
    steps = feed(seq, [1, 2, 3, 4])
    # "o w" is 3 characters: the last 2 are held back until they cannot start a stop string.
    assert steps[0] == ("Hel", "H", None)
    assert steps[1] == ("lo", "el", None)
    assert steps[2] == (" w", "l", "o w")  # fires: the text ends before the stop string
    assert seq.output_text == "Hell"
    assert "".join(shown for _, shown, _ in steps[:3]) == "Hell"


def test_include_stop_str_in_output_keeps_the_stop_string():
    seq = make_seq(stop=["wor"], include_stop_str_in_output=True)
    steps = feed(seq, [1, 2, 3, 4])
    assert steps[-1][2] == "wor"
    assert seq.output_text == "Hello wor"
    assert "".join(shown for _, shown, _ in steps) == "Hello wor"


@pytest.mark.parametrize("stops", [["lo wo"], ["xyz", "lo wo"]])
def test_a_stop_string_spanning_tokens_fires_once_complete(stops):
    seq = make_seq(stop=stops)
    steps = feed(seq, [1, 2, 3, 4, 7])
    assert [s for _, _, s in steps] == [None, None, None, "lo wo"]
    assert seq.output_text == "Hel"
    assert "".join(shown for _, shown, _ in steps) == "Hel"


def test_handed_out_text_adds_up_to_the_text_once_finished():
    seq = make_seq(stop=["zzzz"])
    steps = feed(seq, [1, 2, 3, 4])
    shown = "".join(s for _, s, _ in steps)
    assert shown == "Hello wo" and seq.output_text == "Hello world"  # 3 held back while running
    seq.status = SequenceStatus.FINISHED_LENGTH
    assert shown + detokenizer.take_text(seq) == "Hello world"
    assert detokenizer.take_text(seq) == ""
