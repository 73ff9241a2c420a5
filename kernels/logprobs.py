"""The sampled token's logprob, log_softmax(logits)[row, token], without materialising the log-softmax.

RL rollouts ask for the chosen token's logprob alone (logprobs=0), at every step of every sample. torch's way,
log_softmax in fp32 then a gather, casts and writes a whole [R, V] fp32 copy: at 256 rows of 49,152 that is a
36 us cast and a 57 us softmax a step on an H100, 7 % of a 135M model's 1.4 ms rollout step (torch.profiler
over benchmarks/host_step_bench.py's rollouts). Here one program per row reads its row twice, the row's max
and then the sum of exp(x - max), both per lane and reduced once, and writes one float: the row stays in L2
between the passes, 11 us a step there (the same profile). The same rounding order as torch:
(x[token] - max) - log(sum).
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _token_logprob_kernel(logits_ptr, stride_row, tokens_ptr, rows_ptr, out_ptr, V, HAS_ROWS: tl.constexpr,
                          BLOCK: tl.constexpr):
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64) if HAS_ROWS else i.to(tl.int64)
    base = logits_ptr + row * stride_row
    mvec = tl.full([BLOCK], float("-inf"), tl.float32)
    for k0 in range(0, V, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        mvec = tl.maximum(mvec, tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32))
    m = tl.max(mvec, axis=0)
    svec = tl.zeros([BLOCK], tl.float32)
    for k0 in range(0, V, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        svec += tl.exp(x - m)
    token = tl.load(tokens_ptr + row)
    x_tok = tl.load(base + token).to(tl.float32)
    tl.store(out_ptr + i, (x_tok - m) - tl.log(tl.sum(svec, axis=0)))


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor | None = None,
                   block: int = 2048) -> torch.Tensor:
    """logits [R, V] (last dim contiguous, any float dtype), tokens int [R], rows int [L] or None (every row) ->
    fp32 [L]: log_softmax(logits[rows[i]])[tokens[rows[i]]] (reference.token_logprobs)."""
    assert logits.stride(-1) == 1 and tokens.shape[0] == logits.shape[0]
    n = logits.shape[0] if rows is None else rows.shape[0]
    out = torch.empty(n, dtype=torch.float32, device=logits.device)
    if n:
        _token_logprob_kernel[(n,)](logits, logits.stride(0), tokens, tokens if rows is None else rows, out,
                                    logits.shape[1], HAS_ROWS=rows is not None, BLOCK=block, num_warps=8)
    return out
