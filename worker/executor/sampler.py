"""Token choice for one step on the device: logit_bias, min_tokens, penalties, allowed_token_ids, then temperature,
top-k, top-p, min-p and a seeded draw, and the logprobs, with one host-to-device copy per step and no host sync.

The step's row records (sampling_state.py) and the indices of its penalised and logprobs rows go to the
device in one pinned int32 copy. Greedy rows take the exact argmax in the model's dtype (kernels/greedy.py);
sampled rows are drawn by kernels/sampling.py on CUDA (reference.sample elsewhere, the same draws: the noise
is a counter-based hash of seed, output position and token id, so a seeded row's draw depends on nothing
else in the batch). Penalised rows are processed in fp32 first, in vLLM's order: logit_bias, min_tokens,
then repetition / presence / frequency penalties from the counts their slots keep on the device, then
allowed_token_ids and one-token bad_words (the tokens outside it, or banned, marked in the same slot words) as
-inf. A bad word of several tokens bans its last token in a step whose output ends with the others: the host
compares them (such rows' steps do not overlap) and uploads the few (row, token) pairs. Logprobs
are of the model's logits (vLLM's raw logprobs), computed on the device and read back with the tokens.
Rows with a grammar (structured outputs) get their packed token bitmask uploaded and applied first, before
everything else (-inf where the bit is 0, ids past the bitmask too), with greedy and sampled rows alike.
Sampling runs after the CUDA graphs' replay, outside them, so the mask lands on the graphs' logits buffer.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import numpy as np
import torch

from pagefleet.kernels import reference as ref
from pagefleet.worker.core.outputs import TokenLogprobs
from pagefleet.worker.core.sequence import Sequence
from pagefleet.worker.executor import sampling_state as st
from pagefleet.worker.models.layers import ops

_BIT_SHIFTS: dict[torch.device, torch.Tensor] = {}


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: logits[rows[g], t] = -inf where bit t of bitmask[g] (int32 words, bit t % 32 of word t // 32)
    is 0, and for every t past the bitmask's 32 * W ids. All on the device: no host sync."""
    G, W = bitmask.shape
    V = logits.shape[1]
    shifts = _BIT_SHIFTS.get(logits.device)
    if shifts is None:
        shifts = _BIT_SHIFTS[logits.device] = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).view(G, W * 32).bool()
    if W * 32 >= V:
        allowed = allowed[:, :V]
    else:  # logits wider than the grammar's vocabulary: the extra ids are never allowed
        allowed = torch.cat([allowed, allowed.new_zeros(G, V - W * 32)], dim=1)
    x = logits.index_select(0, rows).masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, rows, x)



# The split sampling path (kernels/sampling_split.py) against one program per row, bf16 logits of 128,256, us on an
# H100 (benchmarks/sampling_bench.py --kernel): top-p 0.95 at 1 / 16 / 64 rows takes 22 / 42 / 109 of device time
# (replayed as one graph) against 163 / 163 / 224, but 336 launched one by one: its 9 launches cost the host more
# than the device. The engine launches sampling while the device still runs the step's forward, so where the
# forward is long (an 8B model) the device time is what a step pays: serving the 8B shape at concurrency 64 with
# top-p 0.95 (H200, docs/benchmarks.md "Top-p by rejection"), the split path up to 64 rows gave a TPOT p50 of
# 7.38 and 7.81 ms in two runs, up to 16 rows 7.83 and 8.93. Temperature alone: 9 / 15 / 37 against 90, and
# top-k 50 86 / 126 / 254 against 142-146, so the split path is for batches with a row whose top-p searches the
# whole vocabulary (no top-k of at most SMALL_TOP_K before it).
SPLIT_MAX_ROWS = 64
SMALL_TOP_K = 256  # the per-row kernel's small buffer (kernels/sampling.py SMALL): top-p works inside it
# The split path's launch classes (top-k, top-p, min-p: whether some row may use it; each class is its own set of
# compiled kernels, all compiled at warm-up): temperature alone, top-p or min-p without top-k, everything.
SPLIT_CLASSES = ((False, False, False), (False, True, True), (True, True, True))


def split_pays(rows: np.ndarray, greedy: np.ndarray) -> bool:
    """rows: the sampler's records [R, ROW]; greedy: the rows left to argmax."""
    if len(rows) > SPLIT_MAX_ROWS:
        return False
    top_p = rows.view(np.float32)[:, ref.TOP_P]
    top_k = rows[:, ref.TOP_K]
    wide = (top_p < 1.0) & ~((top_k > 0) & (top_k <= SMALL_TOP_K)) & ~greedy
    return bool(wide.any())


def split_class(rows: np.ndarray, greedy: np.ndarray) -> tuple[bool, bool, bool]:
    """The least of SPLIT_CLASSES that covers every sampled row's filters."""
    sampled = ~greedy
    f = rows.view(np.float32)
    if ((rows[:, ref.TOP_K] > 0) & sampled).any():
        return SPLIT_CLASSES[2]
    if (((f[:, ref.TOP_P] < 1.0) | (f[:, ref.LOG_MIN_P] > -np.inf)) & sampled).any():
        return SPLIT_CLASSES[1]
    return SPLIT_CLASSES[0]

@dataclass
class Sampled:
    """One step's choice on the device: tokens int64 [R]; for the logprobs rows `lp_rows`, chosen [L] and top
    values / ids [L, k] (k the most any row asked for, None when k is 0; row i keeps its first `lp_counts[i]`)."""

    tokens: torch.Tensor
    lp_rows: list[int]
    lp_counts: list[int]
    chosen: torch.Tensor | None = None
    top_values: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None

    def to_host(self, pin: bool) -> Sampled:
        """Host copies, started without waiting (the caller records an event behind them)."""

        def host(t):
            if t is None:
                return None
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
            return out.copy_(t, non_blocking=True)

        return Sampled(host(self.tokens), self.lp_rows, self.lp_counts, host(self.chosen), host(self.top_values),
                       host(self.top_ids))

    def logprobs(self, tokens: list[int]) -> list[TokenLogprobs | None]:
        """Per row (host copies, read once their event has fired): its TokenLogprobs, None without logprobs."""
        result: list[TokenLogprobs | None] = [None] * len(tokens)
        if not self.lp_rows:
            return result
        chosen = self.chosen.tolist()
        if not any(self.lp_counts):  # the sampled token's logprob alone (RL rollouts): no top lists to read
            for i, logprob in zip(self.lp_rows, chosen, strict=True):
                result[i] = TokenLogprobs(tokens[i], logprob, [])
            return result
        top_values, top_ids = self.top_values.tolist(), self.top_ids.tolist()
        for j, (i, n) in enumerate(zip(self.lp_rows, self.lp_counts, strict=True)):
            result[i] = TokenLogprobs(tokens[i], chosen[j], list(zip(top_ids[j][:n], top_values[j][:n])))
        return result


class Sampler:
    def __init__(self, device: torch.device, seed: int, eos_token_ids: list[int], max_num_seqs: int = 4):
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.state = st.SamplingState(device, seed, max_num_seqs)
        # the Triton kernel on CUDA, its reference elsewhere (imported here: CPU processes skip Triton)
        self.kernel = importlib.import_module("pagefleet.kernels.sampling") if device.type == "cuda" else ref
        self.logprob_kernel = importlib.import_module("pagefleet.kernels.logprobs") if device.type == "cuda" else ref
        # seqs -> (constrained rows int32 [G], bitmask int32 [G, W]) or None; the engine sets it at its first
        # structured request (engine/structured_output.py), so steps before that pay nothing
        self.grammar_bitmask = None

    def forget(self, seq: Sequence) -> None:
        self.state.forget(seq)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits [R, V], one row per sequence in `seqs` -> (token per row, logprobs per row), read back at once."""
        host = self.sample_step(logits, seqs).to_host(pin=False)
        tokens = host.tokens.tolist()
        return tokens, host.logprobs(tokens)

    @torch.inference_mode()
    def sample_on_device(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """The chosen token of every row, left on the device (no host sync here)."""
        return self.sample_step(logits, seqs).tokens

    def needs_outputs(self, seqs: list[Sequence]) -> bool:
        """True where a row's logits this step depend on its last tokens on the host (bad words of several tokens):
        such a step cannot overlap the one still producing them."""
        words = self.state.bad_words
        return bool(words) and any(s.seq_id in words for s in seqs)

    def _bad_word_bans(self, seqs: list[Sequence]) -> tuple[list[int], list[int]] | None:
        """(rows, tokens): the last token of each bad word whose other tokens end that row's output (vLLM's rule)."""
        words = self.state.bad_words
        rows, tokens = [], []
        for i, seq in enumerate(seqs):
            toks, outputs = seq.token_ids, len(seq.token_ids) - seq.num_prompt_tokens
            for ids in words.get(seq.seq_id, ()):
                k = len(ids) - 1  # the output's last k tokens, not the prompt's (vLLM reads the output only)
                if k <= outputs and toks[len(toks) - k:] == ids[:-1]:
                    rows.append(i)
                    tokens.append(ids[-1])
        return (rows, tokens) if rows else None

    @torch.inference_mode()
    def sample_step(self, logits: torch.Tensor, seqs: list[Sequence]) -> Sampled:
        R, V = logits.shape
        mask = self.grammar_bitmask(seqs) if self.grammar_bitmask is not None else None
        lp_rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        rows = self.state.rows(seqs, V, self.eos_token_ids)  # sequences seen first join here
        bans = self._bad_word_bans(seqs) if self.state.bad_words else None
        raw = logits  # the logprobs are of the model's logits, the grammar's mask and the bad words not applied
        if (mask is not None or bans is not None) and lp_rows:
            raw = logits.clone()
        if mask is not None:
            mask_rows, bitmask = self._upload_bitmask(*mask)
            apply_token_bitmask(logits, mask_rows, bitmask)
        if bans is not None:  # a few (row, token) pairs, only in steps that end a bad word's other tokens
            logits[torch.tensor(bans[0], device=self.device), torch.tensor(bans[1], device=self.device)] = float("-inf")
        lp_counts = [seqs[i].params.logprobs for i in lp_rows]
        processed = self.state.processed(seqs, rows)
        greedy = rows[:, ref.INV_TEMPERATURE] == 0  # fp32 0.0 is int 0
        if greedy.all() and not len(processed) and not lp_rows:
            return Sampled(ops.argmax(logits), lp_rows, lp_counts)  # the plain greedy step: nothing to copy
        params, processed_d, lp_rows_d = self._upload(rows, processed, np.asarray(lp_rows, dtype=np.int32))
        x = logits
        if len(processed):
            x = logits.to(torch.float32, copy=True)  # the logprobs below read the model's logits
            self._process(x, params, processed_d.long())
        tokens = ops.argmax(x) if greedy.any() else None  # exact in the model's dtype
        if not greedy.all():
            path = {}
            if self.kernel is not ref:
                path = {"split": split_pays(rows, greedy)}
                if path["split"]:
                    path["filters"] = split_class(rows, greedy)
            tokens = self.kernel.sample(x, params, tokens, **path)
        if len(processed):
            self._count(params, processed_d.long(), tokens)
        return self._with_logprobs(Sampled(tokens, lp_rows, lp_counts), raw, lp_rows_d)

    def _upload(self, rows: np.ndarray, *indices: np.ndarray) -> list[torch.Tensor]:
        """The records [R, ROW] and each index array in one pinned host-to-device copy; each piece 16-byte
        aligned (Triton compiles a kernel variant per pointer alignment)."""
        sizes = [len(a) for a in indices]
        padded = [-(-n // 4) * 4 for n in sizes]
        host = torch.empty(rows.size + sum(padded), dtype=torch.int32, pin_memory=self.device.type == "cuda")
        flat = host.numpy()
        flat[: rows.size] = rows.reshape(-1)
        at = rows.size
        for a, n in zip(indices, padded, strict=True):
            flat[at: at + len(a)] = a
            at += n
        dev = host.to(self.device, non_blocking=True)
        pieces = [dev[: rows.size].view(rows.shape)]
        at = rows.size
        for a, n in zip(indices, padded, strict=True):
            pieces.append(dev[at: at + len(a)])
            at += n
        return pieces

    def _upload_bitmask(self, rows: np.ndarray, bitmask: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows and bitmask in one pinned host-to-device copy (the step is synchronous anyway: the bitmask
        needed the previous token on the host)."""
        G, W = bitmask.shape
        at = -(-G // 4) * 4
        host = torch.empty(at + G * W, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        flat = host.numpy()
        flat[:G] = rows
        flat[at:] = bitmask.reshape(-1)
        dev = host.to(self.device, non_blocking=True)
        return dev[:G].long(), dev[at:].view(G, W)

    def _process(self, x: torch.Tensor, params: torch.Tensor, prow: torch.Tensor) -> None:
        """logit_bias, min_tokens, repetition / presence / frequency penalties, then allowed_token_ids, on rows prow
        of x (fp32)."""
        slots = self.state.slots
        rec = params[prow]
        recf = rec.view(torch.float32)
        slot = rec[:, st.SLOT].long()
        lg = x[prow]
        lg.scatter_add_(1, slots.bias_ids[slot], slots.bias_values[slot])
        ids = slots.banned[slot]
        ban = (rec[:, ref.POSITION] < rec[:, st.MIN_TOKENS])[:, None]
        lg.scatter_(1, ids, torch.where(ban, float("-inf"), lg.gather(1, ids)))
        words = slots.words[slot]
        counts = (words & st.COUNT_MASK).float()
        rp = recf[:, st.REPETITION, None]
        lg = torch.where((words & st.SEEN_MASK) != 0, torch.where(lg > 0, lg / rp, lg * rp), lg)
        lg -= recf[:, st.FREQUENCY, None] * counts + recf[:, st.PRESENCE, None] * (counts > 0).float()
        lg.masked_fill_((words & st.OUTSIDE_BIT) != 0, float("-inf"))
        x[prow] = lg

    def _count(self, params: torch.Tensor, prow: torch.Tensor, tokens: torch.Tensor) -> None:
        """Each processed row's sampled token joins its slot's output counts, on the device."""
        slot = params[prow, st.SLOT].long()
        words = self.state.slots.words
        words.index_put_((slot, tokens[prow]), torch.ones_like(slot, dtype=torch.int32), accumulate=True)

    def _with_logprobs(self, sampled: Sampled, logits: torch.Tensor, rows_d: torch.Tensor) -> Sampled:
        """Log-softmax of the model's logits at the chosen and the top tokens, for the logprobs rows."""
        if not sampled.lp_rows:
            return sampled
        every = len(sampled.lp_rows) == logits.shape[0]  # GRPO rollouts: every row asks, none is picked
        k = max(sampled.lp_counts)
        if not k:
            # The sampled token's logprob alone (RL rollouts): kernels/logprobs.py reads each row twice and writes
            # one float, where log_softmax writes an fp32 copy of the logits (93 of a 135M rollout step's 1,400 us
            # on an H100).
            sampled.chosen = self.logprob_kernel.token_logprobs(logits, sampled.tokens, None if every else rows_d)
            return sampled
        if every:
            sel, tokens = logits, sampled.tokens
        else:
            rows_d = rows_d.long()
            sel, tokens = logits.index_select(0, rows_d), sampled.tokens[rows_d]
        logprobs = torch.log_softmax(sel, dim=1, dtype=torch.float32)  # one pass serves the chosen and the top
        sampled.chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
        sampled.top_values, sampled.top_ids = logprobs.topk(k, dim=1)
        return sampled

    def warm_up(self, logits: torch.Tensor) -> None:
        """Compile the kernel variants a step can need (sampled rows of model-dtype and fp32 logits; the logprob of
        every row or of some, always of the model's logits) at start-up."""
        rows = np.zeros((1, st.ROW), dtype=np.int32)
        rows.view(np.float32)[:, ref.INV_TEMPERATURE] = 1.0
        rows.view(np.float32)[:, ref.TOP_P] = 1.0
        params, picked = self._upload(rows, np.zeros(1, dtype=np.int32))
        tokens = torch.zeros(1, dtype=torch.int64, device=logits.device)
        self.logprob_kernel.token_logprobs(logits[:1], tokens)
        self.logprob_kernel.token_logprobs(logits[:1], tokens, picked)
        paths = [{"split": False}] + [{"split": True, "filters": f} for f in SPLIT_CLASSES]
        for path in paths if self.kernel is not ref else ({},):
            # every path and class: the first batch of another must not stall a server on a compile
            self.kernel.sample(logits[:1], params, **path)
            self.kernel.sample(logits[:1].float(), params, **path)
