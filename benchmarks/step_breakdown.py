"""Where a serving-shaped workload's time goes, by step kind: one engine, a closed loop of C requests in flight.

Each finished request is replaced at once, as a concurrency-C client does (`vllm bench serve --max-concurrency C`,
`pagefleet bench serve --concurrency C`), with no HTTP in the way: its tok/s bounds what a server on this engine
can serve at that concurrency. Every step's forward is timed on the device (CUDA events around
ModelRunner.execute) and filed by kind: decode, prompt or mixed (prompt chunks beside decodes), replayed from a
CUDA graph or run eagerly. The sampler runs outside execute, so wall per step minus execute per step is the host's
share plus sampling.

`--mixed-draw SEED` replaces the fixed lengths with hybrid_bench.py's mixed draw (inputs 64..1024, outputs
32..512, random.seed(SEED)), all requests submitted at once as its offline row does. `--profile N` also lists
the CUDA kernels by device time (torch.profiler) of two windows of N steps: from step 3 (prompt-heavy where
every request arrives at once) and from step 100 (decodes).

Usage: python3 benchmarks/step_breakdown.py MODEL [--quantization fp8] [--kv-cache-dtype fp8] [--concurrency 64]
         [--requests 256] [--input-len 564] [--output-len 128] [--temperature 1.0] [--max-model-len 2048]
         [--fraction 0.85]
         [--mixed-draw 0] [--n 16] [--max-num-seqs N] [--max-num-batched-tokens N] [--mixed-prefill-tokens N]
         [--profile 40]

`--n N` samples N continuations of each prompt, seeded by request, as GRPO rollouts do (side_offline.py --grpo:
`--n 16 --concurrency 64 --requests 64 --input-len 256 --output-len 512 --max-num-seqs 1024`); `--no-cascade` times
the same without the shared-prefix attention (kernels/cascade.py).
"""

from __future__ import annotations

import argparse
import collections
import random
import time

import torch

from pagefleet.worker import EngineConfig, SamplingParams
from pagefleet.worker.engine.llm_engine import LLMEngine


class _HostEvent:
    """torch.cuda.Event's two methods on a CPU clock, so the script runs (slowly) without CUDA."""

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, end: _HostEvent) -> float:
        return (end.t - self.t) * 1e3


def kernel_table(profiler, steps: int, rows: int = 22) -> str:
    """The kernels (ops on CPU) that took the most device time, ms a step each and their share."""
    def self_time(e) -> float:  # µs; device time where there is a device
        return getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0) \
            or e.self_cpu_time_total

    events = sorted(profiler.key_averages(), key=self_time, reverse=True)
    total = sum(self_time(e) for e in events) or 1.0
    lines = [f"{'kernel':<72} {'ms a step':>9} {'share':>6} {'calls':>6}"]
    for e in events[:rows]:
        lines.append(f"{e.key[:72]:<72} {self_time(e) / steps / 1e3:>9.2f} {self_time(e) / total:>6.1%} "
                     f"{e.count // steps:>6}")
    return "\n".join(lines + [f"{'all':<72} {total / steps / 1e3:>9.2f}"])


def bucket(decodes: int) -> str:
    """Decode rows of a step, in the ranges a step's cost moves with (weights once, state and KV per row)."""
    for top in (16, 64, 128, 256, 512):
        if decodes <= top:
            return f"<={top} rows"
    return ">512 rows"


def timed_execute(runner, records: list) -> None:
    """Wrap runner.execute: (kind, prompt tokens, start event, end event) per step into records."""
    execute, replay = runner.execute, runner.cuda_graphs.replay
    cuda = torch.cuda.is_available()
    graphed = {}

    def replay_noting(step, feed=None):
        logits = replay(step, feed)
        graphed["hit"] = logits is not None
        return logits

    def execute_timed(work, feed=None, lora_mapping=None):
        graphed.clear()
        start, end = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda \
            else (_HostEvent(), _HostEvent())
        start.record()
        out = execute(work, feed, lora_mapping)
        end.record()
        step = work.step
        prompt_tokens = 0 if step.is_decode else step.num_tokens - step.num_decodes
        kind = "decode" if step.is_decode else ("mixed" if step.num_decodes else "prompt")
        rows = f" {bucket(step.num_decodes if not step.is_decode else step.num_tokens)}" if kind != "prompt" else ""
        records.append((f"{kind}-{'graph' if graphed.get('hit') else 'eager'}{rows}", prompt_tokens, start, end))
        return out

    runner.cuda_graphs.replay = replay_noting
    runner.execute = execute_timed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--quantization", default=None)
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--input-len", type=int, default=564)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0, help="1.0: the OpenAI and vLLM servers' default")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--fraction", type=float, default=0.85, help="gpu_memory_fraction, as the serving runs use")
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--mixed-draw", type=int, default=None, metavar="SEED",
                   help="hybrid_bench.py's mixed lengths, all requests at once")
    p.add_argument("--n", type=int, default=1, help="samples a prompt, seeded by request (GRPO rollouts)")
    p.add_argument("--no-cascade", action="store_true",
                   help="decode steps past the graphs read each row's whole table (kernels/cascade.py off)")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--mixed-prefill-tokens", type=int, default=None)
    p.add_argument("--profile", type=int, default=0, metavar="STEPS", help="kernel table of STEPS middle steps")
    a = p.parse_args()

    engine = LLMEngine(EngineConfig(model=a.model, max_model_len=a.max_model_len, gpu_memory_fraction=a.fraction,
                                    quantization=a.quantization, kv_cache_dtype=a.kv_cache_dtype,
                                    max_num_seqs=a.max_num_seqs,
                                    max_num_batched_tokens=a.max_num_batched_tokens,
                                    mixed_prefill_tokens=a.mixed_prefill_tokens))
    engine.emit_partial = False
    if a.no_cascade:
        engine.runner.cascade_samples = 0
    records: list = []
    timed_execute(engine.runner, records)
    rng = random.Random(a.seed)
    top = min(120000, engine.model_config.vocab_size - 1)
    lengths = [(a.input_len, a.output_len)] * a.requests
    if a.mixed_draw is not None:
        random.seed(a.mixed_draw)
        lengths = [(random.randint(64, 1024), random.randint(32, 512)) for _ in range(a.requests)]
        a.concurrency = a.requests
    prompts = [[rng.randint(100, top) for _ in range(n)] for n, _ in lengths]

    def params(i: int = 0) -> SamplingParams:
        return SamplingParams(n=a.n, seed=i if a.n > 1 else None, temperature=a.temperature,
                              max_tokens=lengths[i][1], ignore_eos=True, detokenize=False)

    engine.add_request("warm-up", prompts[0][:32], SamplingParams(temperature=a.temperature, max_tokens=4,
                                                                  ignore_eos=True, detokenize=False))
    while engine.has_unfinished_requests():
        engine.step()
    engine.block_manager.reset_prefix_cache()
    records.clear()
    shape = "hybrid_bench's mixed draw" if a.mixed_draw is not None else f"{a.input_len} / {a.output_len} tokens"
    print(f"closed loop: {a.requests} requests of {shape}, {a.concurrency} in flight, temperature {a.temperature}, "
          f"{a.quantization or 'no quantization'}, KV cache {a.kv_cache_dtype}, n {a.n}, "
          f"max_num_seqs {engine.config.max_num_seqs}", flush=True)
    cuda = torch.cuda.is_available()
    windows = (3, 100) if a.profile else ()
    profiler, tables = None, {}
    start = time.perf_counter()
    sent = generated = steps = 0
    for _ in range(min(a.concurrency, a.requests)):
        engine.add_request(f"r{sent}", prompts[sent], params(sent))
        sent += 1
    while engine.has_unfinished_requests():
        if steps in windows:
            activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
            profiler = torch.profiler.profile(activities=[activity])
            profiler.__enter__()
        for out in engine.step():
            if out.finished:
                generated += out.num_generated_tokens
                if sent < a.requests:
                    engine.add_request(f"r{sent}", prompts[sent], params(sent))
                    sent += 1
        steps += 1
        if profiler is not None and steps - a.profile in windows:
            if cuda:
                torch.cuda.synchronize()
            profiler.__exit__(None, None, None)
            tables[steps - a.profile] = kernel_table(profiler, a.profile)
            profiler = None
    wall = time.perf_counter() - start
    if cuda:
        torch.cuda.synchronize()
    kinds = collections.defaultdict(lambda: [0, 0.0, 0])
    for kind, prompt_tokens, s, e in records:
        k = kinds[kind]
        k[0], k[1], k[2] = k[0] + 1, k[1] + s.elapsed_time(e), k[2] + prompt_tokens
    executed = sum(k[1] for k in kinds.values())
    print(f"{generated / wall:,.0f} output tok/s; {steps} steps; wall {wall / steps * 1e3:.2f} ms a step, "
          f"execute {executed / steps:.2f} ms a step")
    print("| step kind | steps | ms each | seconds | prompt tokens a step |\n|---|---|---|---|---|")
    for kind, (n, ms, pt) in sorted(kinds.items()):
        print(f"| {kind} | {n} | {ms / n:.2f} | {ms / 1e3:.2f} | {pt / n:,.0f} |")
    for first, table in tables.items():
        print(f"\nkernels of steps {first}..{first + a.profile - 1}:\n{table}")


if __name__ == "__main__":
    main()
