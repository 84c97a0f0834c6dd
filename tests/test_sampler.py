"""The sampler on hand-made logits (no model): greedy, penalties, min_tokens, filters, seeds,
logprobs."""

import pytest
import torch

from pagedserve.sampler import sample
from pagedserve.sampling_params import SamplingParams
from pagedserve.sequence import Sequence
from pagedserve.structured.masks import MaskFiller

VOCAB = 8
EOS = 7


def seq(i: int = 0, output: list[int] | None = None, prompt: list[int] | None = None, **params):
    s = Sequence(i, f"r{i}", 0, prompt or [1, 2], SamplingParams(**params), max_tokens=64)
    s.output_token_ids = list(output or [])
    if s.params.seed is not None:
        s.generator = torch.Generator().manual_seed(s.params.seed)
    return s


def logits(*rows: list[float], dtype=torch.float32) -> torch.Tensor:
    return torch.tensor(rows, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_takes_each_rows_first_maximum(dtype):
    out = sample(
        logits([0, 1, 5, 5, 0, 0, 0, 0], [9, 0, 0, 0, 0, 0, 0, 0], dtype=dtype),
        [seq(0, temperature=0), seq(1, temperature=0)],
        [EOS],
    )
    assert out.token_ids == [2, 0]
    assert out.logprobs == [None, None]


def test_repetition_presence_and_frequency_penalties_move_greedy_off_seen_tokens():
    row = [0, 0, 3.0, 2.5, 0, 0, 0, 0]
    plain = seq(0, output=[2], temperature=0)
    rep = seq(1, output=[2], temperature=0, repetition_penalty=2.0)  # 3.0 -> 1.5
    pres = seq(2, output=[2], temperature=0, presence_penalty=1.0)  # 3.0 -> 2.0
    freq = seq(3, output=[2, 2], temperature=0, frequency_penalty=0.4)  # 3.0 -> 2.2
    out = sample(logits(row, row, row, row), [plain, rep, pres, freq], [EOS])
    assert out.token_ids == [2, 3, 3, 3]
    # Repetition counts prompt tokens too; presence and frequency only output tokens.
    prompt_rep = seq(4, prompt=[2], temperature=0, repetition_penalty=2.0)
    prompt_pres = seq(5, prompt=[2], temperature=0, presence_penalty=1.0)
    assert sample(logits(row, row), [prompt_rep, prompt_pres], [EOS]).token_ids == [3, 2]


def test_min_tokens_blocks_eos_and_stop_tokens_until_reached():
    row = [0, 0, 0, 0, 0, 1.0, 4.0, 5.0]  # EOS (7) best, stop token 6 next
    short = seq(0, output=[1], temperature=0, min_tokens=2, stop_token_ids=[6])
    done = seq(1, output=[1, 1], temperature=0, min_tokens=2, stop_token_ids=[6])
    no_eos = seq(2, output=[], temperature=0, min_tokens=1, ignore_eos=True)
    out = sample(logits(row, row, row), [short, done, no_eos], [EOS])
    assert out.token_ids == [5, 7, 7]  # ignore_eos: EOS is an ordinary token


def test_top_k_one_and_a_tiny_top_p_sample_the_top_token():
    row = [0, 1.0, 2.0, 1.9, 0, 0, 0, 0]
    seqs = [seq(0, temperature=1.0, top_k=1), seq(1, temperature=1.0, top_p=0.01)]
    for _ in range(20):
        assert sample(logits(row, row), seqs, [EOS]).token_ids == [2, 2]


def test_min_p_drops_tokens_below_its_share_of_the_top():
    row = [-30, -30, 2.0, 1.5, -30, -30, -30, -30]
    s = seq(0, temperature=1.0, min_p=0.5)  # p(3) / p(2) = e^-0.5 = 0.61 stays; the rest go
    picks = {sample(logits(row), [s], [EOS]).token_ids[0] for _ in range(50)}
    assert picks <= {2, 3} and 2 in picks


def test_a_seeded_row_draws_the_same_tokens_whatever_else_is_in_the_batch():
    row = [0.5, 0.4, 0.3, 0.2, 0.1, 0.0, 0.1, 0.2]

    def draws(batch_extra: int) -> list[int]:
        s = seq(0, temperature=1.0, seed=123)
        others = [seq(i + 1, temperature=1.0) for i in range(batch_extra)]
        out = []
        for _ in range(8):
            rows = logits(*([row] * (1 + batch_extra)))
            out.append(sample(rows, [s, *others], [EOS]).token_ids[0])
        return out

    assert draws(0) == draws(3)


def test_logprobs_are_of_the_raw_distribution_with_the_chosen_and_top_tokens():
    row = [0, 1.0, 3.0, 2.0, 0, 0, 0, 0]
    raw = torch.log_softmax(torch.tensor(row), dim=-1)
    # Penalized so that greedy picks token 3, outside the top 1; logprobs ignore the penalty.
    s = seq(0, output=[2], temperature=0, presence_penalty=2.0, logprobs=1)
    plain = seq(1, temperature=0, logprobs=0)
    out = sample(logits(row, row), [s, plain], [EOS])
    assert out.token_ids == [3, 2]
    assert out.logprobs[0].keys() == {3, 2}
    assert out.logprobs[0][3] == pytest.approx(raw[3].item())
    assert out.logprobs[0][2] == pytest.approx(raw[2].item())
    assert out.logprobs[1] == {2: pytest.approx(raw[2].item())}


def test_a_token_constraint_masks_every_token_it_does_not_allow():
    class OnlyOdd:
        def fill_mask(self, words: torch.Tensor) -> None:
            words.fill_(int(0xAAAAAAAA - (1 << 32)))  # bits 1, 3, 5, ...: the odd tokens

        def advance(self, token_id: int) -> bool:
            return True

        def is_complete(self) -> bool:
            return False

        def fork(self) -> "OnlyOdd":
            return self

    row = [0, 1.0, 9.0, 2.0, 0, 0, 0, 0]
    free = seq(0, temperature=0)
    constrained = seq(1, temperature=0)
    constrained.constraint = OnlyOdd()
    sampled = seq(2, temperature=1.0)
    sampled.constraint = OnlyOdd()
    seqs = [free, constrained, sampled]
    filler = MaskFiller(len(row))
    mask = filler.start(seqs).result()  # the engine's way: filled on the filler's thread
    filler.shutdown()
    assert mask.rows.tolist() == [1, 2]
    out = sample(logits(row, row, row), seqs, [EOS], mask)
    assert out.token_ids[:2] == [2, 3]
    assert out.token_ids[2] % 2 == 1
