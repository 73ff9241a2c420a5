"""What --quantization fp8 does to a trained model's next-token distribution, on CPU.

The bundled SmolLM2-135M-Instruct (a trained Llama; the GPU benchmarks' 8B checkpoints have random weights,
which say nothing about quality) writes greedy fp32 continuations of a few chat prompts. Then each model
variant is teacher-forced along those continuations: at every position, one 1-token request with the path
so far as its prompt (the prefix cache makes that cheap), keeping the top-20 logprobs. Against fp32, per
variant: how often its top token is fp32's, and |logprob of fp32's top token - fp32's| (mean, p50, p95, max).

Variants: bf16; FP8 as `--quantization fp8` builds it (worker/fp8.py: e4m3 weights with per-channel scales,
activations quantised per token), run through the plain-torch references: the prompt steps' numerics; the
same e4m3 weights with activations left alone: the decode graphs' numerics (our GEMV reads e4m3 weights
and unquantised activations); and FP8 built from the bf16 model.

Usage: python3 benchmarks/fp8_quality.py [--prompts 8] [--tokens 32]
"""
from __future__ import annotations

import argparse
import time

import torch

from pagefleet.kernels.reference import quantize_weight_fp8
from pagefleet.worker import LLM, SamplingParams
from pagefleet.worker.models.layers.fp8 import decoder_linears, quantize_linears_fp8
from pagefleet.worker.core.outputs import TokenLogprobs

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis in two sentences.",
           "List three prime numbers.", "How do I boil an egg?", "What is 12 times 7?", "Name a famous painter.",
           "Why is the sky blue?"]
TOP = 20  # logprobs kept a position; a reference token outside the top counts at the 20th's logprob
# name: (dtype, FP8 form); "weights": e4m3 weights dequantised in place, activations untouched (decode graphs)
# "tensor weights": one scale a weight, as vLLM's dynamic `--quantization fp8` quantises an unquantised checkpoint
VARIANTS = {"bf16": ("bfloat16", None), "fp8": ("float32", "w8a8"), "fp8, weights only": ("float32", "weights"),
            "fp8, weights only, one scale a tensor": ("float32", "tensor weights"), "fp8 from bf16": ("bfloat16", "w8a8")}


def new_llm(model: str | None, dtype: str) -> LLM:
    return LLM(model, dtype=dtype, enable_prefix_caching=True, max_num_batched_tokens=4096, max_num_seqs=256)


def quantize(llm: LLM, form: str) -> None:
    """`--quantization fp8`'s linears ("w8a8"), or only their e4m3 weights, dequantised in place ("weights",
    per output channel as ours; "tensor weights", one scale for the whole weight)."""
    model = llm.engine.runner.model
    if form == "w8a8":
        quantize_linears_fp8(model)
        return
    with torch.no_grad():
        for parent, name in decoder_linears(model):
            w = getattr(parent, name).weight
            if form == "tensor weights":
                scale = w.abs().max().float().clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
                w.copy_((w.float() / scale).to(torch.float8_e4m3fn).float().mul(scale).to(w.dtype))
                continue
            q, scale = quantize_weight_fp8(w)
            w.copy_(q.to(w.dtype) * scale.to(w.dtype)[:, None])


def greedy_paths(llm: LLM, prompts: list[str], tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    """(chat prompt ids, the greedy continuation of each, `tokens` long)."""
    ids = [llm.chat_prompt_ids([{"role": "user", "content": p}]) for p in prompts]
    outs = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
    return ids, [o.outputs[0].token_ids for o in outs]


def teacher_forced(llm: LLM, ids: list[list[int]], paths: list[list[int]]) -> list[TokenLogprobs]:
    """The model's next-token top logprobs at every position of every path, in path order."""
    llm.engine.block_manager.reset_prefix_cache()  # nothing computed by another variant's weights
    prompts = [p + path[:i] for p, path in zip(ids, paths) for i in range(len(path))]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, logprobs=TOP))
    return [o.outputs[0].logprobs[0] for o in outs]


def compare(ref: list[TokenLogprobs], other: list[TokenLogprobs]) -> dict:
    """Top-1 agreement with ref, and |delta logprob| of ref's top token at each position."""
    diffs = []
    for r, o in zip(ref, other, strict=True):
        token, logprob = r.top[0]
        diffs.append(abs(dict(o.top).get(token, o.top[-1][1]) - logprob))
    diffs.sort()
    return {"top1_agreement": sum(r.top[0][0] == o.top[0][0] for r, o in zip(ref, other)) / len(ref),
            "mean": sum(diffs) / len(diffs), "p50": diffs[len(diffs) // 2], "p95": diffs[int(0.95 * (len(diffs) - 1))],
            "max": diffs[-1], "positions": len(diffs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="checkpoint folder (default: the bundled model)")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    if not (1 <= args.prompts <= len(PROMPTS) and args.tokens >= 1):
        ap.error(f"--prompts takes 1..{len(PROMPTS)} and --tokens 1 or more")
    rows = {}
    llm = new_llm(args.model, "float32")
    ids, paths = greedy_paths(llm, PROMPTS[: args.prompts], args.tokens)
    ref = teacher_forced(llm, ids, paths)
    del llm
    for name, (dtype, form) in VARIANTS.items():
        start = time.time()
        llm = new_llm(args.model, dtype)  # fresh weights for every variant
        if form:
            quantize(llm, form)
        rows[name] = compare(ref, teacher_forced(llm, ids, paths))
        print(f"{name}: {rows[name]} ({time.time() - start:.1f}s)", flush=True)
        del llm
    print(f"| against fp32 ({len(ref)} positions) | top-1 agreement | mean |Δ logprob| | p50 | p95 | max |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {100 * r['top1_agreement']:.1f} % | {r['mean']:.3f} | {r['p50']:.3f} | {r['p95']:.3f} | {r['max']:.3f} |")


if __name__ == "__main__":
    main()
