"""Run T probe (kept on this branch only): a decode layer stack (qkv GEMV, attention with RoPE + KV write, o_proj, gated gate_up, down) x 32 in one
CUDA graph, under each PDL mode (kernels/pdl.py), in turns; plus o_proj twice on one weight (L2 reuse)."""
import statistics, sys
sys.path.insert(0, "benchmarks")
import torch
from decode_profile import time_graph
from kv_layout_bench import cache, block_tables, LAYERS, H, HKV, D, BS
from pagefleet.kernels import pdl
from pagefleet.kernels.attention import paged_decode_attention
from pagefleet.kernels.gemv import skinny_matmul

torch.manual_seed(0)
HID, INTER = H * D, 14336
num_blocks = int(40 * 2**30 // (2 * LAYERS * BS * HKV * D * 2))
data = cache("token", num_blocks)
def w(n, k):
    return torch.randn(LAYERS, n, k, dtype=torch.bfloat16, device="cuda") * 0.01
Wqkv, Wo, Wgu, Wd = w(HID + 2 * HKV * D, HID), w(HID, HID), w(2 * INTER, HID), w(HID, INTER)
gen = torch.Generator().manual_seed(0)

def stack(b, ctx):
    tables = block_tables(num_blocks, b, ctx, gen)
    x = torch.randn(b, HID, dtype=torch.bfloat16, device="cuda")
    qkv = torch.empty(b, HID + 2 * HKV * D, dtype=torch.bfloat16, device="cuda")
    positions = torch.full((b,), ctx - 1, dtype=torch.long, device="cuda")
    cos_sin = torch.randn(ctx, D, dtype=torch.float32, device="cuda")
    slots = tables[:, (ctx - 1) // BS].long() * BS + (ctx - 1) % BS
    seq_lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
    attn = torch.empty(b, H, D, dtype=torch.bfloat16, device="cuda")
    h = torch.empty(b, HID, dtype=torch.bfloat16, device="cuda")
    act = torch.empty(b, INTER, dtype=torch.bfloat16, device="cuda")
    def fn():
        for l in range(LAYERS):
            skinny_matmul(x, Wqkv[l], out=qkv)
            q = qkv[:, :HID].view(b, H, D)
            k = qkv[:, HID:HID + HKV * D].view(b, HKV, D)
            v = qkv[:, HID + HKV * D:].view(b, HKV, D)
            paged_decode_attention(q, data[0, l], data[1, l], tables, seq_lens, out=attn, new_kv=(k, v, positions, cos_sin, slots))
            skinny_matmul(attn.view(b, HID), Wo[l], out=h)
            skinny_matmul(h, Wgu[l], gated=True, out=act)
            skinny_matmul(act, Wd[l], out=x)
    return fn, x

# same results under every mode (PDL only changes when programs may start)
ref = None
for m in range(6):
    pdl.MODE = m
    torch.manual_seed(5)
    fn, x = stack(16, 640)
    x.copy_(torch.randn_like(x))
    g = torch.cuda.CUDAGraph()
    fn()
    x.copy_(torch.randn(16, HID, generator=torch.Generator().manual_seed(3)).to(x))
    with torch.cuda.graph(g):
        fn()
    x.copy_(torch.randn(16, HID, generator=torch.Generator().manual_seed(3)).to(x))
    g.replay()
    torch.cuda.synchronize()
    out = x.float().clone()
    if ref is None:
        ref = out
    print(f"mode {m}: max |diff| vs mode 0 {(out - ref).abs().max().item():.3e}, finite {torch.isfinite(out).all().item()}", flush=True)

shapes = [(1, 640), (8, 640), (16, 640)]
times = {}
for turn in range(3):
    for b, ctx in shapes:
        for m in range(6):
            pdl.MODE = m
            times.setdefault((b, ctx, m), []).append(time_graph(stack(b, ctx)[0]) / LAYERS)
    print("turn", turn, flush=True)
pdl.MODE = 0
names = ["off", "attribute only", "wait at entry", "wait+release at entry", "wait, release after loop", "prefetch, wait, release after loop"]
print("| batch | " + " | ".join(names) + " |")
print("|---|" + "---|" * len(names))
for b, ctx in shapes:
    print(f"| {b} | " + " | ".join(f"{statistics.median(times[(b, ctx, m)]):.1f}" for m in range(6)) + " |", flush=True)

# L2 reuse: o_proj twice on one weight against two weights
xo = torch.randn(16, HID, dtype=torch.bfloat16, device="cuda")
yo = torch.empty_like(xo)
Wo2 = w(HID, HID)
for name, second in (("same weight twice", Wo), ("two weights", Wo2)):
    def fn2():
        for l in range(LAYERS):
            skinny_matmul(xo, Wo[l], out=yo)
            skinny_matmul(xo, second[l], out=yo)
    print(f"o_proj pair, {name}: {time_graph(fn2) / LAYERS:.1f} µs", flush=True)
