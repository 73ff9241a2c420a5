"""Plain-torch Gated DeltaNet operations: the ground truth of gated_delta.py and causal_conv.py, and the CPU path.

Numerically they follow transformers' Qwen3.5 layer (fp32 state and maths, one rounding to the model dtype),
over packed variable-length batches whose sequences each own a state slot. Layouts (the contract with the model):
  x, y            [T, C] packed tokens, conv channels C = 2 * Hk * Dk + Hv * Dv (q, k, v before the conv)
  conv_state      [slots, C, K - 1]: each slot's last K - 1 conv inputs, oldest first (model dtype)
  ssm_state       [slots, Hv, Dk, Dv]: each slot's recurrent state (fp32; bf16 / fp16 storage is read up to fp32)
  cu_seqlens      int32 [num_seqs + 1]: start of each sequence's tokens in the packed rows
  state_slots     int32 [num_seqs]: each sequence's slot; -1 is a padding row (no read, no write, zero output)
A sequence always continues from its slot's state (the engine zeroes a fresh slot), so one prompt may arrive in
chunks over several steps.
"""
import torch
import torch.nn.functional as F


def l2norm(x, eps=1e-6):
    """x / sqrt(sum(x^2) + eps) over the last dim, in fp32 (transformers' and FLA's form)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gdn_gating(A_log, a, dt_bias, b):
    """-> (g, beta) fp32 [T, Hv]: the log decay g = -exp(A_log) * softplus(a + dt_bias) and beta = sigmoid(b)."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, b.float().sigmoid()


def _seq_ranges(cu_seqlens, state_slots, num_tokens):
    if cu_seqlens is None:  # one token per sequence
        return [(i, i + 1, int(s)) for i, s in enumerate(state_slots.tolist())]
    starts = cu_seqlens.tolist()
    return [(starts[i], starts[i + 1], int(s)) for i, s in enumerate(state_slots.tolist())]


# ---------------------------------------------------------------- causal conv1d


def causal_conv1d(x, weight, conv_state, state_slots, cu_seqlens=None):
    """Depthwise causal conv over each sequence's tokens, continued from its slot's conv state, then SiLU.

    x [T, C] (any row stride), weight [C, K] -> y [T, C] in x.dtype (fp32 maths). cu_seqlens None: one token
    per sequence (decode). The slot's state becomes the sequence's last K - 1 inputs, in place.
    """
    T, C = x.shape
    K = weight.shape[1]
    y = torch.zeros(T, C, dtype=x.dtype, device=x.device)
    w = weight.float()[:, None, :]
    for a, b, slot in _seq_ranges(cu_seqlens, state_slots, T):
        if slot < 0 or b <= a:
            continue
        ext = torch.cat([conv_state[slot].float(), x[a:b].float().t()], dim=1)  # [C, K - 1 + L]
        out = F.conv1d(ext[None], w, groups=C)[0]  # [C, L]
        y[a:b] = F.silu(out).t().to(x.dtype)
        conv_state[slot] = ext[:, ext.shape[1] - (K - 1):].to(conv_state.dtype)
    return y


# ---------------------------------------------------------------- the gated delta rule


def _expand_heads(q, k, hv):
    """GQA of the rule: each q/k head serves Hv / Hk consecutive value heads."""
    rep = hv // q.shape[1]
    return (q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)) if rep > 1 else (q, k)


def _prepare(q, k, v):
    hv, dk = v.shape[1], q.shape[-1]
    q, k = _expand_heads(l2norm(q), l2norm(k), hv)
    return q * dk**-0.5, k


def chunk_gated_delta_rule_one(q, k, v, g, beta, state, chunk_size=64):
    """One sequence, chunked (transformers' torch_chunk_gated_delta_rule): q, k [L, Hv, Dk] normalised and q
    scaled, v [L, Hv, Dv], g, beta [L, Hv] fp32, state [Hv, Dk, Dv] fp32 -> (o [L, Hv, Dv] fp32, new state)."""
    L = q.shape[0]
    pad = (chunk_size - L % chunk_size) % chunk_size
    # [Hv, chunks, C, D]
    q, k, v = (F.pad(t.float().transpose(0, 1), (0, 0, 0, pad)) for t in (q, k, v))
    beta, g = (F.pad(t.float().t(), (0, pad)) for t in (beta, g))
    H, n = q.shape[0], (L + pad) // chunk_size
    q, k, v = (t.reshape(H, n, chunk_size, -1) for t in (q, k, v))
    beta, g = beta.reshape(H, n, chunk_size), g.reshape(H, n, chunk_size)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    G = g.cumsum(-1)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(upper, float("-inf")).exp()  # exp(G_i - G_j), i >= j
    # (I + strictly-lower(beta_i k_i.k_j decay_ij)) X = rhs: the UT transform of the chunk's delta updates
    system = (k_beta @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * G.exp()[..., None], upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * G.exp()[..., None]
    k_decayed = k * (G[..., -1:] - G).exp()[..., None]
    out = torch.zeros_like(v)
    S = state.float()
    for i in range(n):
        v_new = u[:, i] - w[:, i] @ S
        out[:, i] = q_decayed[:, i] @ S + attn[:, i] @ v_new
        S = S * G[:, i, -1].exp()[:, None, None] + k_decayed[:, i].transpose(-1, -2) @ v_new
    return out.reshape(H, -1, out.shape[-1])[:, :L].transpose(0, 1), S


def chunk_gated_delta_rule(q, k, v, g, beta, ssm_state, state_slots, cu_seqlens, chunk_size=64):
    """Prefill (or prompt chunks) of several sequences: q, k [T, Hk, Dk] and v [T, Hv, Dv] straight from the conv
    (l2-normalised here, q scaled by Dk^-0.5), g, beta [T, Hv] fp32 -> o [T, Hv, Dv] in v.dtype; each sequence
    starts from and leaves its state in ssm_state[slot]."""
    o = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    qn, kn = _prepare(q, k, v)
    for a, b, slot in _seq_ranges(cu_seqlens, state_slots, v.shape[0]):
        if slot < 0 or b <= a:
            continue
        out, S = chunk_gated_delta_rule_one(qn[a:b], kn[a:b], v[a:b], g[a:b], beta[a:b], ssm_state[slot], chunk_size)
        o[a:b] = out.to(v.dtype)
        ssm_state[slot] = S.to(ssm_state.dtype)
    return o


def recurrent_gated_delta_rule(q, k, v, g, beta, ssm_state, state_slots):
    """Decode: one token per sequence (row i is sequence i), the rule's recurrent step, batched.
    Shapes as chunk_gated_delta_rule's, with T = num_seqs."""
    o = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    keep = (state_slots >= 0).nonzero().squeeze(1)
    if keep.numel() == 0:
        return o
    slots = state_slots[keep].long()
    qn, kn = _prepare(q[keep], k[keep], v[keep])  # [B, Hv, Dk]
    S = ssm_state[slots].float() * g[keep].exp()[..., None, None]  # [B, Hv, Dk, Dv]
    kv = (S * kn[..., None]).sum(-2)
    delta = (v[keep].float() - kv) * beta[keep][..., None]
    S = S + kn[..., None] * delta[..., None, :]
    o[keep] = (S * qn[..., None]).sum(-2).to(v.dtype)
    ssm_state[slots] = S.to(ssm_state.dtype)
    return o


# ---------------------------------------------------------------- gated RMSNorm


def gated_rms_norm(x, z, weight, eps=1e-6):
    """The DeltaNet output norm: rms_norm(x) * weight * silu(z) over the last dim (Dv), x, z [..., Dv]; rounded
    as transformers' Qwen3_5RMSNormGated (the weighted norm in the model dtype, the gate in fp32)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(x.dtype)
    return (h * F.silu(z.float())).to(x.dtype)
