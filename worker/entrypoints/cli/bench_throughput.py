"""`pagefleet bench throughput`: offline throughput of the engine, optionally beside transformers generate().

Requests are drawn exactly as the shared anchors draw them, so figures compare across runs and systems:
random.seed(S); lengths = [(randint(in_lo, in_hi), randint(out_lo, out_hi)) ...]; prompt ids random in [100, 120000).
"""

from __future__ import annotations

import argparse
import json
import random
import time

from pagefleet.worker.core.sampling_params import SamplingParams
from pagefleet.worker.entrypoints.engine_args import add_engine_arguments, engine_config_from_args
from pagefleet.worker.executor.startup.gc_freeze import frozen_heap

WASTE_SAMPLE_EVERY = 8  # steps between KV-waste samples (a sample walks every block table)


def draw_requests(n: int, seed: int, input_range: tuple[int, int], output_range: tuple[int, int],
                  vocab: int) -> list[tuple[list[int], int]]:
    random.seed(seed)
    lengths = [(random.randint(*input_range), random.randint(*output_range)) for _ in range(n)]
    top = min(120000, vocab)
    return [([random.randint(100, top - 1) for _ in range(i)], o) for i, o in lengths]


def run_engine(engine, requests, warmup: bool = True, prompt_logprobs: int | None = None) -> dict:
    """prompt_logprobs: every request also scores its prompt (lm-eval-harness's loglikelihood requests)."""
    if warmup:  # compile kernels / first-touch memory outside the timed region
        engine.add_request("warmup", requests[0][0][:32],
                           SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False))
        while engine.has_unfinished_requests():
            engine.step()
    engine.emit_partial = False
    engine.block_manager.reset_prefix_cache()  # nothing from an earlier workload (or the warm-up) is cached
    used = alloc = 0
    with frozen_heap():  # as `pagefleet serve` runs: no full GC pass over the start-up heap mid-run
        start = time.perf_counter()
        for i, (ids, out_len) in enumerate(requests):
            engine.add_request(f"bench-{i}", ids, SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True,
                                                                 detokenize=False, prompt_logprobs=prompt_logprobs))
        steps = 0
        generated = 0
        preempt0 = engine.scheduler.num_preemptions
        while engine.has_unfinished_requests():
            for out in engine.step():
                generated += out.num_generated_tokens
            steps += 1
            if steps % WASTE_SAMPLE_EVERY == 0:
                u, a = engine.kv_waste()
                used, alloc = used + u, alloc + a
        elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(ids) for ids, _ in requests)
    return {
        "requests": len(requests),
        "seconds": elapsed,
        "requests_per_s": len(requests) / elapsed,
        "output_tok_per_s": generated / elapsed,
        "total_tok_per_s": (generated + prompt_tokens) / elapsed,
        "output_tokens": generated,
        "kv_waste": 1.0 - used / alloc if alloc else 0.0,
        "preemptions": engine.scheduler.num_preemptions - preempt0,
        "steps": steps,
    }


def run_static(engine, batch: int, prompt_len: int, output_len: int) -> dict:
    """run_engine on `batch` requests of exactly prompt_len / output_len tokens (the anchors' draw, seed =
    batch), after an untimed run of the same shapes on other prompts (reversed, 2 output tokens): the timed
    steps find their kernels compiled and their memory touched."""
    requests = draw_requests(batch, batch, (prompt_len, prompt_len), (output_len, output_len),
                             engine.model_config.vocab_size)
    run_engine(engine, [(ids[::-1], 2) for ids, _ in requests], warmup=False)
    return run_engine(engine, requests, warmup=False)


def run_hf(model_path, requests, batch_size: int, device: str, dtype) -> dict:
    """transformers generate() in static batches, left padding, each batch runs to its longest output."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype).to(device).eval()
    useful = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for b in range(0, len(requests), batch_size):
            chunk = requests[b : b + batch_size]
            width = max(len(ids) for ids, _ in chunk)
            ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in chunk], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk], device=device)
            longest = max(o for _, o in chunk)
            model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=longest, min_new_tokens=longest,
                           pad_token_id=0)
            useful += sum(o for _, o in chunk)
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "output_tok_per_s": useful / elapsed, "output_tokens": useful}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--input-len", type=int, nargs=2, default=[64, 1024], metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=[32, 512], metavar=("MIN", "MAX"))
    parser.add_argument("--dataset-seed", type=int, default=0)
    parser.add_argument("--baseline", choices=["hf"], default=None,
                        help="also run transformers generate() on the same requests")
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--json-out", default=None, help="write the figures as JSON here")
    parser.add_argument("--prompt-logprobs", type=int, default=None, metavar="K", choices=range(21),
                        help="every request also scores its prompt, K (0..20) top logprobs a token (prompt_logprobs)")


def run(args: argparse.Namespace) -> int:
    from pagefleet.worker.engine.llm_engine import LLMEngine

    engine = LLMEngine(engine_config_from_args(args))
    requests = draw_requests(args.num_requests, args.dataset_seed, tuple(args.input_len), tuple(args.output_len),
                             engine.model_config.vocab_size)
    print(f"pagefleet bench throughput: {len(requests)} requests, input {args.input_len}, output {args.output_len}, "
          f"seed {args.dataset_seed}, model {engine.model_name}", flush=True)
    ours = run_engine(engine, requests, prompt_logprobs=args.prompt_logprobs)
    result = {"pagefleet": ours}
    print(
        f"pagefleet    : {ours['requests_per_s']:.2f} req/s, {ours['output_tok_per_s']:.1f} output tok/s, "
        f"{ours['total_tok_per_s']:.1f} total tok/s, KV waste {100 * ours['kv_waste']:.2f} %, "
        f"preemptions {ours['preemptions']}, {ours['seconds']:.1f} s",
        flush=True,
    )
    if args.baseline == "hf":
        hf = run_hf(engine.model_path, requests, args.hf_batch_size, str(engine.runner.device), engine.runner.dtype)
        result["transformers"] = hf
        result["ratio"] = ours["output_tok_per_s"] / hf["output_tok_per_s"]
        print(f"transformers : {hf['output_tok_per_s']:.1f} useful output tok/s "
              f"(static batches of {args.hf_batch_size}), {hf['seconds']:.1f} s", flush=True)
        print(f"ratio        : {result['ratio']:.2f}x output tok/s", flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=2)
    return 0
