"""The Sampler on CPU: SamplingParams onto the device records (chi-square against the exact distributions),
logit_bias / min_tokens / penalties / allowed_token_ids against a plain per-row reference over several steps
(counts kept on the device), logprobs against log_softmax, a row's draw independent of the batch beside it."""

import math
from collections import Counter

import pytest
import torch

from pagefleet.worker.core.sampling_params import SamplingParams
from pagefleet.worker.core.sequence import Sequence
from pagefleet.worker.executor import sampler as sampler_module
from pagefleet.worker.executor.sampler import Sampler

EOS = [2]


def seq(params: SamplingParams, prompt=(5, 6, 7, 5), outputs=(), seed=None) -> Sequence:
    s = Sequence("r", 0, [*prompt, *outputs], len(prompt), params, seed if seed is not None else params.seed)
    return s


def make_sampler() -> Sampler:
    return Sampler(torch.device("cpu"), 0, list(EOS))


def chi_square_p(counts: torch.Tensor, expected: torch.Tensor) -> float:
    assert counts[expected == 0].sum() == 0, "drew a token the parameters exclude"
    live = expected > 0
    e = expected[live] * counts.sum()
    stat = ((counts[live] - e) ** 2 / e).sum()
    df = int(live.sum()) - 1
    return 1.0 if df == 0 else float(torch.special.gammaincc(torch.tensor(df / 2.0), stat / 2.0))


LOGITS = torch.tensor([1.8, 1.5, 1.2, 0.7, 0.3, 0.0, -0.4, -0.9, -1.5, -2.5])


def softmax_over(x, keep):
    return torch.where(keep, torch.softmax(torch.where(keep, x, -math.inf), 0), 0.0)


@pytest.mark.parametrize("params,expected", [
    (SamplingParams(temperature=0.7), lambda x: torch.softmax(x / 0.7, 0)),
    (SamplingParams(top_k=3), lambda x: softmax_over(x, torch.arange(10) < 3)),
    # probabilities 0.27, 0.20, 0.15, 0.09 ...: 0.27 + 0.20 < 0.55 <= 0.27 + 0.20 + 0.15
    (SamplingParams(top_p=0.55), lambda x: softmax_over(x, torch.arange(10) < 3)),
    # p_i / p_max >= 0.2 <=> x_i >= 1.8 + log(0.2) = 0.19
    (SamplingParams(min_p=0.2), lambda x: softmax_over(x, x >= 0.19)),
], ids=["temperature", "top_k", "top_p", "min_p"])
def test_sampled_rows_follow_the_exact_distribution(params, expected):
    """6,000 sequences of one request shape, seeded 0 ... 5,999, over the same logits row, in one step."""
    n = 6000
    seqs = [seq(params, seed=i) for i in range(n)]
    tokens, _ = make_sampler().sample(LOGITS.repeat(n, 1), seqs)
    counts = torch.bincount(torch.tensor(tokens), minlength=10).double()
    want = expected(LOGITS.double())
    assert chi_square_p(counts, want) > 1e-3, (counts / n, want)


def plain_processed(logits: torch.Tensor, s: Sequence) -> torch.Tensor:
    """logit_bias, min_tokens, repetition / presence / frequency penalties, then allowed_token_ids, one token at a
    time."""
    p = s.params
    x = logits.clone()
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    if s.num_output_tokens < p.min_tokens:
        for t in [*p.stop_token_ids, *([] if p.ignore_eos else EOS)]:
            x[t] = -math.inf
    outputs = s.output_token_ids
    for t in set(s.token_ids):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, c in Counter(outputs).items():
        x[t] -= p.frequency_penalty * c + p.presence_penalty
    if p.allowed_token_ids:
        x[[t for t in range(len(x)) if t not in p.allowed_token_ids]] = -math.inf
    return x


class Spy:
    """Records the logits each sampling launch (greedy argmax and the draw) is given."""

    def __init__(self, monkeypatch, sampler):
        self.seen = []
        argmax, draw = sampler_module.ops.argmax, sampler.kernel.sample

        def spy_argmax(x):
            self.seen.append(x.clone())
            return argmax(x)

        class Kernel:
            @staticmethod
            def sample(x, params, out=None, split=None, filters=None):  # the reference has one path: the same draw
                self.seen.append(x.clone())
                return draw(x, params, out)

        monkeypatch.setattr(sampler_module.ops, "argmax", spy_argmax)
        sampler.kernel = Kernel


def test_penalties_logit_bias_and_min_tokens_match_a_plain_reference(monkeypatch):
    """Six steps over rows with each processing alone and together, beside plain rows, sampled and greedy:
    the logits the draw sees equal the plain reference's for every processed row, as the device counts grow
    with the sampled tokens and min_tokens runs out."""
    V = 40
    kinds = [
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
        SamplingParams(temperature=0.9, presence_penalty=0.7, frequency_penalty=0.4, seed=3),
        SamplingParams(temperature=0.0, logit_bias={3: 5.0, 9: -100.0, 30: 2.5}),
        SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=[4, 11], seed=4),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.1, repetition_penalty=0.8, frequency_penalty=-0.5, presence_penalty=0.2,
                       logit_bias={1: 1.0}, min_tokens=2, seed=5),
        SamplingParams(temperature=0.8, seed=6),
        SamplingParams(temperature=0.0, allowed_token_ids=[3, 17, 25]),  # 3 is in the prompt: penalised too
        SamplingParams(temperature=1.3, allowed_token_ids=[1, 3, 30, 31], repetition_penalty=1.4,
                       frequency_penalty=0.3, seed=7),
    ]
    seqs = [seq(p, prompt=(1, 3, 3, 8 + i)) for i, p in enumerate(kinds)]
    seqs[0].token_ids += [12, 12]  # outputs before joining are counted at join
    sampler = make_sampler()
    spy = Spy(monkeypatch, sampler)
    g = torch.Generator().manual_seed(0)
    for _ in range(6):
        logits = torch.randn(len(seqs), V, generator=g) * 3
        spy.seen.clear()
        tokens, _ = sampler.sample(logits, seqs)
        x = spy.seen[-1]
        assert x.dtype == torch.float32
        for i, s in enumerate(seqs):
            want = plain_processed(logits[i], s) if i != 4 and i != 6 else logits[i]
            assert torch.allclose(x[i], want, atol=1e-5, equal_nan=False), (i, x[i], want)
        for s, t in zip(seqs, tokens):
            s.token_ids.append(t)
    assert all(t not in (4, 11) for t in seqs[3].output_token_ids[:3])
    assert set(seqs[7].output_token_ids) <= {3, 17, 25} and set(seqs[8].output_token_ids) <= {1, 3, 30, 31}


def test_slots_are_reused_and_grow_without_losing_counts():
    """More penalised sequences than the first slots hold, some forgotten midway: each keeps its own counts."""
    sampler = make_sampler()
    params = SamplingParams(temperature=0.0, frequency_penalty=1.0, logit_bias={0: 0.5})
    seqs = [seq(params, prompt=(i,)) for i in range(3)]
    logits = torch.zeros(3, 16)
    logits[:, 7] = 1.0  # greedy picks 7 until its count pushes it below the others
    sampler.sample(logits, seqs)
    sampler.forget(seqs[1])
    more = [seq(params, prompt=(9,)) for _ in range(9)]
    batch = [seqs[0], seqs[2], *more]
    tokens, _ = sampler.sample(torch.zeros(len(batch), 16).index_fill_(1, torch.tensor([7]), 1.0), batch)
    assert tokens[:2] == [0, 0] and tokens[2:] == [7] * 9  # 7 - 1.0 (counted once) < 0 + 0.5 (bias)
    words = sampler.state.slots.words
    assert words.shape[0] >= 11 and int((words & 0xFFFF).sum()) == 2 + 2 + 9


def test_logprobs_are_the_model_logits_log_softmax():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 50, generator=g)
    seqs = [seq(SamplingParams(temperature=0.0, logprobs=3)), seq(SamplingParams(temperature=0.8, seed=1)),
            seq(SamplingParams(temperature=1.0, logprobs=0, repetition_penalty=1.3, seed=2)),
            seq(SamplingParams(temperature=0.0, logprobs=5, logit_bias={7: 50.0}))]
    tokens, logprobs = make_sampler().sample(logits, seqs)
    ls = torch.log_softmax(logits, dim=-1)
    assert logprobs[1] is None and tokens[3] == 7
    for i, n in ((0, 3), (2, 0), (3, 5)):
        lp = logprobs[i]
        assert lp.token_id == tokens[i] and lp.logprob == pytest.approx(ls[i, tokens[i]].item(), abs=1e-5)
        top = ls[i].topk(n)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-5)


def test_sampled_token_logprobs_alone_skip_the_top_lists():
    """Rollouts ask only the sampled token's logprob (logprobs=0): each such row gets it with an empty top list,
    a row without logprobs None, whatever their order."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 40, generator=g)
    asks = (0, None, 0, 0, None)
    seqs = [seq(SamplingParams(temperature=1.0, seed=i, logprobs=n)) for i, n in enumerate(asks)]
    tokens, logprobs = make_sampler().sample(logits, seqs)
    ls = torch.log_softmax(logits, dim=-1)
    for i, n in enumerate(asks):
        if n is None:
            assert logprobs[i] is None
            continue
        assert logprobs[i].token_id == tokens[i] and logprobs[i].top == []
        assert logprobs[i].logprob == pytest.approx(ls[i, tokens[i]].item(), abs=1e-5)


def test_a_seeded_row_draws_the_same_whatever_runs_beside_it():
    g = torch.Generator().manual_seed(2)
    row = torch.randn(1, 64, generator=g)
    target = SamplingParams(temperature=0.9, top_p=0.9, top_k=20, seed=42)
    alone, _ = make_sampler().sample(row, [seq(target)])
    others = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, presence_penalty=1.0),
              SamplingParams(temperature=0.5, logprobs=2), SamplingParams(temperature=1.0)]
    for k in range(len(others) + 1):
        batch = [seq(p) for p in others[:k]] + [seq(target)]
        logits = torch.cat([torch.randn(k, 64, generator=g), row])
        tokens, _ = make_sampler().sample(logits, batch)
        assert tokens[-1] == alone[0]


def test_split_sampling_path_only_for_batches_of_up_to_64_rows_with_a_whole_row_top_p():
    """The split kernel pays only for top-p searching the whole vocabulary in a batch of up to 64 rows (sampler.py's
    figures); every other setting, and any batch past SPLIT_MAX_ROWS, stays on one program per row."""
    import numpy as np

    from pagefleet.kernels import reference as ref
    from pagefleet.worker.executor import sampler
    from pagefleet.worker.executor import sampling_state as st

    def rows(*settings):
        r = np.zeros((len(settings), st.ROW), dtype=np.int32)
        for i, (temp, top_k, top_p) in enumerate(settings):
            r.view(np.float32)[i, ref.INV_TEMPERATURE] = 0.0 if temp == 0 else 1.0 / temp
            r[i, ref.TOP_K] = top_k
            r.view(np.float32)[i, ref.TOP_P] = top_p
            r.view(np.float32)[i, ref.LOG_MIN_P] = -np.inf  # min-p off, as sampling_state records it
        return r, r[:, ref.INV_TEMPERATURE] == 0

    assert sampler.split_pays(*rows((1.0, 0, 0.95)))
    assert sampler.split_pays(*rows((1.0, 0, 1.0), (0.0, 0, 1.0), (0.8, 0, 0.9)))  # one wide row is enough
    assert sampler.split_pays(*rows((1.0, 1000, 0.95)))  # a top-k past the small buffer still searches wide
    assert not sampler.split_pays(*rows((1.0, 0, 1.0)))  # temperature alone
    assert not sampler.split_pays(*rows((0.8, 50, 0.95)))  # top-p inside top-k's buffer
    assert not sampler.split_pays(*rows((0.0, 0, 0.95)))  # a greedy row's top-p is never used
    assert not sampler.split_pays(*rows(*[(1.0, 0, 0.95)] * (sampler.SPLIT_MAX_ROWS + 1)))
    # the launch class covers every sampled row's filters, and ignores the greedy rows'
    plain, with_p, every = sampler.SPLIT_CLASSES
    assert sampler.split_class(*rows((1.0, 0, 1.0), (0.0, 40, 0.5))) == plain
    assert sampler.split_class(*rows((1.0, 0, 1.0), (0.8, 0, 0.9))) == with_p
    assert sampler.split_class(*rows((1.0, 0, 0.9), (0.8, 1000, 1.0))) == every
    r, greedy = rows((1.0, 0, 1.0))
    r.view(np.float32)[0, ref.LOG_MIN_P] = -3.0  # min-p needs the row's max, as top-p does
    assert sampler.split_class(r, greedy) == with_p
