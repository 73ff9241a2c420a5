"""The engine on one GPU, in one run: correctness against transformers, then the anchor workloads.

Sections (each prints as it goes, failures are reported and the run goes on):
  ceilings      device copy bandwidth and bf16 matmul rate, measured here
  correctness   4-layer Llama-3.1-8B / Qwen3-8B shapes: our logprobs (bf16 and FP8, graphs and eager;
                prefill chunks mixed with decodes) against transformers in fp32
  hf            transformers generate() on the first 64 requests of the mixed workload (one static batch)
  static        batch 1 / 8 (512 in, 128 out), 64 / 128 / 256 (512 in, 256 out), time includes prefill
  eager         batch 1 / 8 as above: graphs against an engine started with enforce_eager, as vLLM measured
                its 4.6x, and against the graphed engine with its decode graphs off
  mixed         256 requests (seed 0) and 2048 requests (seed 1), the anchors' draws
  roofline      one decode step against its floor (weights + KV bytes / copy bandwidth)
  fp8           --quantization fp8: static, mixed 256 / 2048, and the decode steps against their floor
  startup       `pagefleet generate` process start to first token, in a fresh process
Usage: python3 benchmarks/gpu_bench.py OUT_DIR [sections...]   (writes OUT_DIR/gpu_bench.json as it goes)

Over 300 lines on purpose: one file is one GPU session, and its sections share one engine and one checkpoint.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
import traceback

import torch
from make_checkpoint import make_checkpoint, roomy  # benchmarks/ is on sys.path: it holds this script

from pagefleet.worker import EngineConfig, SamplingParams
from pagefleet.worker.core.sequence import SequenceStatus
from pagefleet.worker.engine.llm_engine import LLMEngine
from pagefleet.worker.entrypoints.cli.bench_throughput import draw_requests, run_engine, run_hf, run_static

OUT = sys.argv[1] if len(sys.argv) > 1 else "."
SECTIONS = sys.argv[2:] or ["ceilings", "correctness", "hf", "static", "eager", "mixed", "roofline", "startup"]


ROOT = "/dev/shm/pagefleet" if roomy("/dev/shm", 40e9) else "/tmp/pagefleet"  # tmpfs makes the 16 GB write quick
RESULTS: dict = {}


def save():
    with open(os.path.join(OUT, "gpu_bench.json"), "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)


def section(name):
    def wrap(fn):
        def run(*a, **k):
            if name not in SECTIONS:
                return None
            print(f"\n=== {name}", flush=True)
            start = time.time()
            try:
                return fn(*a, **k)
            except Exception as e:
                RESULTS.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
            finally:
                print(f"=== {name} took {time.time() - start:.1f}s", flush=True)
                save()
        return run
    return wrap


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """The device-to-device copy rate, bytes read + written per second: the floors' denominator."""
    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * nbytes * 10 / (time.perf_counter() - t)


@section("ceilings")
def ceilings():
    bw = copy_bandwidth()
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        a @ a
    torch.cuda.synchronize()
    tflops = 2 * 8192**3 * 10 / (time.perf_counter() - t) / 1e12
    RESULTS["ceilings"] = {"copy_bytes_per_s": bw, "bf16_tflops": tflops}
    print(f"copy {bw / 1e12:.2f} TB/s, bf16 matmul {tflops:.0f} TFLOP/s")
    del a
    torch.cuda.empty_cache()


def engine_settings(path, **kw) -> dict:
    # vLLM's offline defaults on this GPU class (its anchor figures ran on them): 1024 sequences, 16384 batched
    # tokens. Only the 2048-request mixed workload runs past 512 at once (512 -> 1024 gave bf16 9,869 -> 10,132
    # and FP8 12,458 -> 13,177 tok/s, docs/benchmarks.md); decode graphs stop at 512 sequences either way.
    return {**dict(model=path, max_model_len=4224, max_num_seqs=1024, max_num_batched_tokens=16384,
                   gpu_memory_fraction=0.9), **kw}


def engine(path, **kw):
    return LLMEngine(EngineConfig(**engine_settings(path, **kw)))


@section("correctness")
def correctness():
    from transformers import AutoModelForCausalLM

    out = {}
    for name in ("llama-3.1-8b", "qwen3-8b"):
        path = make_checkpoint(name, f"{ROOT}/{name}-4layers", num_layers=4, std=0.05)
        prompts = [list(range(1000, 1000 + n)) for n in (300, 45, 700, 17)]
        got = {}
        for variant in ("graphs", "eager", "fp8 graphs", "fp8 eager"):
            eng = engine(path, enforce_eager="eager" in variant, quantization="fp8" if "fp8" in variant else None,
                         max_num_batched_tokens=128, max_num_seqs=16, gpu_memory_fraction=0.3)
            for i, p in enumerate(prompts):
                eng.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True, logprobs=0,
                                                          detokenize=False))
            res = {}
            mixed = 0
            while eng.has_unfinished_requests():
                for o in eng.step():
                    if o.finished:
                        res[o.request_id] = o.outputs[0]
                r = eng.stats().recent_steps[-1]
                mixed += bool(r.num_prefill_tokens and r.num_decode_tokens)
            got[variant] = (res, mixed)
            del eng
            gc.collect()
            torch.cuda.empty_cache()
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
        worst = {}
        for variant, (res, mixed) in got.items():
            diffs, agree, total = [], 0, 0
            for i, p in enumerate(prompts):
                toks = res[str(i)].token_ids
                with torch.inference_mode():
                    logits = hf(torch.tensor([p + toks], device="cuda")).logits[0].float()
                lp = torch.log_softmax(logits, -1)[len(p) - 1 : len(p) - 1 + len(toks)]
                ref = lp.gather(1, torch.tensor(toks, device="cuda")[:, None]).squeeze(1).tolist()
                ours = [e.logprob for e in res[str(i)].logprobs]
                diffs += [abs(a - b) for a, b in zip(ours, ref, strict=False)]
                agree += sum(int(t == a) for t, a in zip(toks, lp.argmax(-1).tolist(), strict=False))
                total += len(toks)
            worst[variant] = {"max_abs_logprob_diff": max(diffs), "mean_abs_logprob_diff": sum(diffs) / len(diffs),
                              "greedy_agreement": agree / total, "mixed_steps": mixed}
        del hf
        gc.collect()
        torch.cuda.empty_cache()
        out[name] = worst
        print(name, json.dumps(worst))
    RESULTS["correctness"] = out


@section("hf")
def hf_baseline(path):
    reqs = draw_requests(256, 0, (64, 1024), (32, 512), 128256)[:64]
    r = run_hf(path, reqs, 64, "cuda", torch.bfloat16)
    RESULTS["hf_mixed64"] = r
    print(f"transformers, first 64 requests of mixed-256: {r['output_tok_per_s']:.1f} useful output tok/s "
          f"in {r['seconds']:.1f}s")
    gc.collect()
    torch.cuda.empty_cache()


STATIC_SHAPES = ((1, 512, 128), (8, 512, 128), (64, 512, 256), (128, 512, 256), (256, 512, 256))  # batch, in, out


@section("static")
def static(eng):
    rows = {}
    for b, i, o in STATIC_SHAPES:
        rows[b] = r = run_static(eng, b, i, o)
        print(f"batch {b}: {r['output_tok_per_s']:.1f} output tok/s ({r['seconds']:.2f}s)", flush=True)
    RESULTS["static"] = rows


EAGER_BATCHES = (1, 8)  # 512 prompt and 128 output tokens, as vLLM's enforce_eager figures (ANCHORS.md)


def eager_rows(settings: dict) -> dict:
    """{batch: {graphs, decode_graphs_off, enforce_eager}} output tok/s for EngineConfig(**settings): the graphed
    engine, the same engine with only its decode graphs switched off (prompt graphs, mixed graphs and folded
    norms stay), then an engine started with enforce_eager; one engine at a time on the GPU."""
    rows = {b: {} for b in EAGER_BATCHES}
    eng = LLMEngine(EngineConfig(**settings))
    for b in EAGER_BATCHES:
        rows[b]["graphs"] = run_static(eng, b, 512, 128)["output_tok_per_s"]
        decode_graphs, eng.runner.graphs = eng.runner.graphs, None
        rows[b]["decode_graphs_off"] = run_static(eng, b, 512, 128)["output_tok_per_s"]
        eng.runner.graphs = decode_graphs
    del eng, decode_graphs  # the graphs hold the model and its KV cache: all of it goes before the next engine
    gc.collect()
    torch.cuda.empty_cache()
    eng = LLMEngine(EngineConfig(**settings, enforce_eager=True))
    for b in EAGER_BATCHES:
        rows[b]["enforce_eager"] = run_static(eng, b, 512, 128)["output_tok_per_s"]
    del eng
    gc.collect()
    torch.cuda.empty_cache()
    return rows


@section("eager")
def eager(path):
    """Engines of their own (one graphed, one enforce_eager), so it runs once the shared engine is gone."""
    rows = eager_rows(engine_settings(path))
    for b, r in rows.items():
        r["speedup"] = r["graphs"] / r["enforce_eager"]
        print(f"batch {b}: --enforce-eager {r['enforce_eager']:.1f}, decode graphs off {r['decode_graphs_off']:.1f}, "
              f"graphs {r['graphs']:.1f} tok/s -> {r['speedup']:.2f}x", flush=True)
    RESULTS["eager_vs_graphs"] = rows


@section("mixed")
def mixed(eng):
    rows = {}
    for n, seed in ((64, 0), (256, 0), (2048, 1)):
        reqs = draw_requests(n if n != 64 else 256, seed, (64, 1024), (32, 512), 128256)[:n]
        r = run_engine(eng, reqs, warmup=False)
        rows[f"{n}_seed{seed}"] = r
        print(f"mixed {n} (seed {seed}): {r['output_tok_per_s']:.1f} output tok/s, {r['total_tok_per_s']:.1f} total, "
              f"KV waste {100 * r['kv_waste']:.2f} %, preemptions {r['preemptions']}, {r['seconds']:.1f}s",
              flush=True)
    RESULTS["mixed"] = rows


def fake_prefilled(eng, batch, ctx):
    """Sequences whose first ctx-1 tokens count as cached (KV left as is): decode timing without prefill."""
    for i in range(batch):
        eng.add_request(f"roof-{i}", [100 + (i * 7 + j) % 100000 for j in range(ctx)],
                        SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, detokenize=False))
    sched, bm = eng.scheduler, eng.block_manager
    while sched.waiting:
        seq = sched.waiting.popleft()
        assert bm.allocate(seq, ctx - 1)
        seq.num_computed_tokens = ctx - 1
        seq.status = SequenceStatus.RUNNING
        sched.running.append(seq)


def abort_all(eng):
    """Abort every request (fake_prefilled's, say) and step until the engine holds nothing."""
    for rid in list(eng.requests):
        eng.abort_request(rid)
    while eng.has_unfinished_requests() or eng.pending is not None:
        eng.step()


@section("roofline")
def roofline(eng):
    RESULTS["roofline"] = decode_steps(eng)


def decode_steps(eng, sizes=(1, 8, 64, 128, 256), contexts=(1024, 4096)):
    """Each batch size at each context (1k and 4k): one decode step's time against its floor (the bytes of every
    weight, in the dtype stored, and of the KV read, over the copy bandwidth)."""
    bw = RESULTS.get("ceilings", {}).get("copy_bytes_per_s", 4.27e12)
    mc = eng.model_config
    weight_bytes = sum(p.numel() * p.element_size() for p in eng.runner.model.parameters())
    kv_per_token = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * 2
    rows = []
    for ctx in contexts:
        for b in sizes:
            need = b * -(-(ctx + 64) // eng.block_manager.block_size)
            if need > eng.block_manager.num_free_blocks:
                rows.append({"batch": b, "context": ctx,
                             "skipped": f"needs {need} blocks, cache has {eng.block_manager.num_blocks}"})
                print(rows[-1], flush=True)
                continue
            eng.emit_partial = False
            fake_prefilled(eng, b, ctx)
            for _ in range(3):
                eng.step()
            torch.cuda.synchronize()
            steps = 20
            t = time.perf_counter()
            for _ in range(steps):
                eng.step()
            dt = (time.perf_counter() - t) / steps
            floor = (weight_bytes + b * (ctx + 10) * kv_per_token) / bw
            rows.append({"batch": b, "context": ctx, "step_ms": dt * 1e3, "floor_ms": floor * 1e3,
                         "of_floor": floor / dt})
            print(f"decode b={b} ctx={ctx}: {dt * 1e3:.2f} ms/step, floor {floor * 1e3:.2f} ms -> "
                  f"{100 * floor / dt:.1f} %", flush=True)
            abort_all(eng)
    return rows


@section("fp8")
def fp8(path):
    t = time.time()
    eng = engine(path, quantization="fp8")  # the bf16 sections' settings, so the figures compare
    rows = {"engine_init_s": time.time() - t}
    rows["decode_steps"] = decode_steps(eng, (1, 8, 16, 64, 128, 256))
    for b, i, o in STATIC_SHAPES:
        rows[f"static_{b}"] = run_static(eng, b, i, o)
        print(f"fp8 batch {b}: {rows[f'static_{b}']['output_tok_per_s']:.1f} output tok/s", flush=True)
        RESULTS["fp8"] = rows
    for n, seed in ((256, 0), (2048, 1)):
        r = run_engine(eng, draw_requests(n, seed, (64, 1024), (32, 512), 128256), warmup=False)
        rows[f"mixed_{n}_seed{seed}"] = r
        print(f"fp8 mixed {n} (seed {seed}): {r['output_tok_per_s']:.1f} output tok/s, "
              f"KV waste {100 * r['kv_waste']:.2f} %, {r['seconds']:.1f}s", flush=True)
    RESULTS["fp8"] = rows
    del eng
    gc.collect()
    torch.cuda.empty_cache()


@section("startup")
def startup(path):
    t = time.time()
    p = subprocess.run([sys.executable, "-m", "pagefleet", "generate", "--model", path, "--max-tokens", "1",
                        "--max-model-len", "2048", "--max-num-seqs", "256", "--max-num-batched-tokens", "8192",
                        "t5 t6 t7"], capture_output=True, text=True)
    RESULTS["startup_s"] = time.time() - t
    print(p.stdout[-500:], p.stderr[-1500:])
    print(f"process start to first token (and exit): {RESULTS['startup_s']:.1f}s")


def main():
    os.makedirs(OUT, exist_ok=True)
    ceilings()
    correctness()
    big = None
    if any(s in SECTIONS for s in ("hf", "static", "eager", "mixed", "roofline", "fp8", "startup")):
        big = make_checkpoint("llama-3.1-8b", f"{ROOT}/llama-3.1-8b")
    hf_baseline(big)
    if any(s in SECTIONS for s in ("static", "mixed", "roofline")):
        t = time.time()
        eng = engine(big)
        RESULTS["engine_init_s"] = time.time() - t
        RESULTS["kv_blocks"] = eng.block_manager.num_blocks
        RESULTS["graph_capture_s"] = eng.runner.graphs.capture_seconds if eng.runner.graphs else None
        print(f"engine up in {RESULTS['engine_init_s']:.1f}s: {eng.block_manager.num_blocks} KV blocks, "
              f"profile {getattr(eng.runner, 'profile', None)}", flush=True)
        static(eng)
        mixed(eng)
        roofline(eng)
        del eng
        gc.collect()
        torch.cuda.empty_cache()
    eager(big)
    fp8(big)
    startup(big)
    save()
    print(json.dumps(RESULTS, indent=1, default=str))


if __name__ == "__main__":
    main()
