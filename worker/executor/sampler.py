"""Token choice for one step on the device: penalties, temperature, top-k/top-p/min-p, per-sequence seeds.

Rows of one step are sampled together; one host transfer returns the chosen tokens (and logprobs).
A seeded sequence draws its noise from its own generator, so its output does not depend on what
else is in the batch.
"""

from __future__ import annotations

import torch

from pagefleet.worker.models.layers import ops
from pagefleet.worker.core.outputs import TokenLogprobs
from pagefleet.worker.core.sequence import Sequence


class Sampler:
    def __init__(self, device: torch.device, seed: int, eos_token_ids: list[int]):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)  # unseeded requests
        self.seq_generators: dict[int, torch.Generator] = {}
        self.eos_token_ids = eos_token_ids

    def forget(self, seq: Sequence) -> None:
        self.seq_generators.pop(seq.seq_id, None)

    def _generator(self, seq: Sequence) -> torch.Generator:
        g = self.seq_generators.get(seq.seq_id)
        if g is None:
            g = self.seq_generators[seq.seq_id] = torch.Generator(device=self.device).manual_seed(seq.seed)
        return g

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits [R, V], one row per sequence in `seqs` -> (token per row, logprobs per row)."""
        want_logprobs = [s.params.logprobs is not None for s in seqs]
        raw_logprobs = torch.log_softmax(logits.float(), dim=-1) if any(want_logprobs) else None
        tokens = self.sample_on_device(logits, seqs)
        return tokens.tolist(), self._logprobs(raw_logprobs, tokens, seqs, want_logprobs)

    @torch.inference_mode()
    def sample_on_device(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """The chosen token of every row, left on the device (no host sync here)."""
        if any(self._needs_processing(s) for s in seqs):
            logits = self._apply_penalties(logits.float(), seqs)
        greedy = [s.params.greedy for s in seqs]
        tokens = ops.argmax(logits)  # exact in the model dtype
        if not all(greedy):  # decided on the host: no device sync
            tokens = torch.where(torch.tensor(greedy, device=logits.device), tokens, self._sample_random(logits.float(), seqs))
        return tokens

    @staticmethod
    def _needs_processing(seq: Sequence) -> bool:
        p = seq.params
        return p.repetition_penalty != 1.0 or bool(p.presence_penalty or p.frequency_penalty) or seq.num_output_tokens < p.min_tokens

    def _apply_penalties(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        for row, seq in enumerate(seqs):
            p = seq.params
            if p.repetition_penalty != 1.0:
                # HF/vLLM semantics: every token seen in prompt or output, positive logits divided, negative multiplied
                seen = torch.tensor(sorted(set(seq.token_ids)), device=logits.device, dtype=torch.long)
                vals = logits[row, seen]
                logits[row, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            if (p.presence_penalty or p.frequency_penalty) and seq.num_output_tokens:
                out = torch.tensor(seq.output_token_ids, device=logits.device, dtype=torch.long)
                counts = torch.bincount(out, minlength=logits.shape[1]).float()
                logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
            if seq.num_output_tokens < p.min_tokens:
                banned = list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_token_ids)
                if banned:
                    logits[row, banned] = float("-inf")
        return logits

    def _sample_random(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        dev = logits.device
        temps = torch.tensor([max(s.params.temperature, 1e-5) for s in seqs], device=dev)
        logits = logits / temps[:, None]
        top_k = [s.params.top_k if s.params.top_k > 0 else logits.shape[1] for s in seqs]
        top_p = [s.params.top_p for s in seqs]
        min_p = [s.params.min_p for s in seqs]
        if any(k < logits.shape[1] for k in top_k) or any(p < 1.0 for p in top_p):
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            ranks = torch.arange(logits.shape[1], device=dev)
            sorted_logits.masked_fill_(ranks[None, :] >= torch.tensor(top_k, device=dev)[:, None], float("-inf"))
            probs = sorted_logits.softmax(dim=-1)
            # keep the smallest prefix whose mass reaches top_p (the first token always stays)
            beyond = (probs.cumsum(dim=-1) - probs) >= torch.tensor(top_p, device=dev)[:, None]
            sorted_logits.masked_fill_(beyond, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter_(1, order, sorted_logits)
        probs = logits.softmax(dim=-1)
        if any(m > 0 for m in min_p):
            floor = torch.tensor(min_p, device=dev)[:, None] * probs.amax(dim=-1, keepdim=True)
            probs = probs.masked_fill(probs < floor, 0.0)
        # Exponential-race sampling (argmax of p / E, E ~ Exp(1)) equals drawing from p, and lets a
        # seeded row draw its noise from its own generator.
        noise = torch.empty_like(probs)
        unseeded = [i for i, s in enumerate(seqs) if s.seed is None]
        if unseeded:
            noise[unseeded] = torch.empty((len(unseeded), probs.shape[1]), device=dev).exponential_(generator=self.generator)
        for i, s in enumerate(seqs):
            if s.seed is not None:
                noise[i].exponential_(generator=self._generator(s))
        return ops.argmax(probs / noise)

    def _logprobs(self, raw, tokens, seqs, want) -> list[TokenLogprobs | None]:
        if raw is None:
            return [None] * len(seqs)
        rows = [i for i, w in enumerate(want) if w]
        k = max(seqs[i].params.logprobs for i in rows)
        chosen = raw[rows].gather(1, tokens[rows, None]).squeeze(1).tolist()
        top_vals, top_ids = (raw[rows].topk(k, dim=-1) if k else (raw[rows][:, :0], raw[rows][:, :0].long()))
        top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
        result: list[TokenLogprobs | None] = [None] * len(seqs)
        tok = tokens.tolist()
        for j, i in enumerate(rows):
            n = seqs[i].params.logprobs
            result[i] = TokenLogprobs(tok[i], chosen[j], list(zip(top_ids[j][:n], top_vals[j][:n])))
        return result
