"""The hybrid model (Gated DeltaNet + gated full attention) at Qwen3.6-27B's text shape on one GPU: make its
random-weight checkpoint, check our logprobs against transformers on a 4-layer cut, then time vLLM's anchor
workloads and print each figure beside the anchor's (../shared/ANCHORS.md).

  check [--out OUT]          a 4-layer cut (3 DeltaNet + 1 full attention) made in a scratch folder: our logprobs
                             (bf16, chunked prefill + 16 greedy decode steps) against transformers' forward in bf16
                             on the same tokens; exits 1 when they differ by more than bf16 noise
  make DIR [--layers N]      the checkpoint of peer/qwen36_anchor.py's `make` (same config, seed, tokenizer)
  run DIR OUT                batch 1 (512/128), mixed 256 (seed 0) greedy and at temperature 1, GRPO rollouts
                             (--grpo-prompts x n=16, 256/512, temperature 1, seeded), mixed 2048 (seed 1) greedy;
                             OUT/hybrid_bench.json
  --tiny                     a tiny Qwen3.5 config on whatever device there is, workloads cut to a few tokens:
                             the code paths of all three, for tests/models/test_hybrid_bench.py

On one GPU session run check first: its scratch checkpoint (~9 GB) has left /dev/shm before make fills it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass

import torch

from pagefleet.worker.core.config import MAMBA_SSM_DTYPES

# peer/qwen36_anchor.py's text config: Qwen3.6-27B's shape (ANCHORS.md), 64 layers = 16 x (3 DeltaNet + 1 full)
TEXT_27B = dict(
    hidden_size=5120, intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4,
    head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, vocab_size=248320, max_position_embeddings=32768,
    tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    eos_token_id=1, bos_token_id=0, dtype="bfloat16")
# tests/engine_models.py's tiny_qwen3_5 shape, with a vision tower of one block so the skip path loads too
TEXT_TINY = dict(
    TEXT_27B, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, vocab_size=512, max_position_embeddings=1024, initializer_range=0.2,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [2, 1, 1], "mrope_interleaved": True})
VISION_TINY = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                   num_position_embeddings=64)

# vLLM 0.26 on this checkpoint, same H200 kind, 2026-12-01 (ANCHORS.md); None: no anchor figure for that row
VLLM = {"init_s": 231.0, "batch1": 63.6, "mixed256": 2647.5, "mixed256_t1": None, "grpo": None, "mixed2048": None}
ANCHOR_LABEL = "vLLM anchor, same H200 kind, not side by side"
COPY_BYTES_PER_S = 4.27e12  # H200 device-to-device copy (ANCHORS.md), its batch-1 floor: weight bytes / this

# Check thresholds, from transformers on this 4-layer cut (vocabulary cut to 4,096, CPU, 200 positions, the same
# bf16 weights): its bf16 forward against its fp32 one differs by max 0.095, mean 0.029 nats at the top token and
# agrees on 95 % of the argmaxes (logits ~1.5 wide). Ours against transformers has bf16 rounding on both sides,
# about sqrt(2) of that: max ~0.14, mean ~0.04; this check itself on that CPU cut (our bf16 engine, 4 prompts,
# 68 positions) gave max 0.157, mean 0.043, agreement 0.94. The bug variants the check prints beside, measured
# there in fp32: a conv that ignores its state max 9.3 / mean 5.4 / agreement 0.01; decay without dt_bias
# 4.4 / 0.81 / 0.32; the write gate fixed at 0.5 5.6 / 2.1 / 0.06 (in that bf16 check run: 8.0 / 4.9 / 0.00,
# 2.9 / 0.69 / 0.41, 5.5 / 2.4 / 0.06). The limits sit ~3x above the noise and >= 4x below the mildest bug.
MAX_ABS = 0.5  # max |d logprob| of the chosen tokens, nats
MEAN_ABS = 0.15  # mean |d logprob|
MIN_AGREE = 0.8  # transformers' argmax equal to our greedy token, share of positions (near-ties flip a few)

# Engines start with no compile workers unless --compile-workers says otherwise. A worker's twin of this model
# (worker/executor/startup/compile_workers.py) is all 64 layers unless layer_types is cut with num_hidden_layers;
# cut to two layers it is still ~6.6 GB of weights (the 248k vocabulary twice) plus 1,280 one-layer state slots (4 GB)
# plus its warm-up steps, times up to 6 workers, beside the engine's 54 GB while it loads (it waits for them before
# it allocates its ~36 GB of state slots, bringup.py): ~120 GB of the card's 141 at the peak, not yet tried on the
# H200. Serial compiles cost start-up seconds only.
COMPILE_WORKERS = 0


@dataclass
class Workloads:
    """The anchor's workloads; --tiny cuts the lengths so a CPU runs them in seconds."""

    warm: tuple = (4, 64, 8)  # requests, in, out: the anchor's untimed go([(64, 8)] * 4)
    batch1: tuple = (512, 128)
    mixed: tuple = (256, 0, (64, 1024), (32, 512))  # requests, seed, input range, output range
    grpo: tuple = (256, 512, 16)  # prompt tokens, output tokens, n samples
    mixed2048: tuple = (2048, 1, (64, 1024), (32, 512))  # ANCHORS.md's larger draw
    max_model_len: int = 2048
    token_range: tuple = (100, 240000)  # the anchor's prompt ids, rng.randint(100, 240000)
    check_lens: tuple = (300, 45, 700, 17, 129, 1, 512, 64)  # prompt lengths of the check
    check_chunk: int = 256  # the check's token budget: the long prompts prefill in chunks beside decodes


TINY = Workloads(warm=(2, 8, 2), batch1=(16, 8), mixed=(8, 0, (4, 40), (2, 12)), grpo=(16, 8, 4),
                 mixed2048=(16, 1, (4, 40), (2, 12)), max_model_len=256, token_range=(100, 511),
                 check_lens=(30, 5, 70, 2, 17, 1, 50, 9), check_chunk=16)


def log(msg: str) -> None:
    print(f"[hybrid_bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


# ---- make


def hf_config(layers: int | None, tiny: bool):
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config

    text = dict(TEXT_TINY if tiny else TEXT_27B)
    if layers:
        text["num_hidden_layers"] = layers
    return Qwen3_5Config(text_config=text, **({"vision_config": VISION_TINY} if tiny else {}))


def build(layers: int | None, tiny: bool, make_every_weight_count: bool = False):
    """The anchor's model: seed 0, born on the GPU (float32, then bf16), transformers' own initialisation."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForConditionalGeneration

    cfg = hf_config(layers, tiny)
    start = time.time()
    torch.manual_seed(0)
    # float32 first, as the anchor draws it, where the card holds that copy (the 27B's 109 GB fit an H200, not an
    # 80 GB H100); else drawn in bf16 straight away: other values, the same shapes and scales
    dtype = torch.float32
    if torch.cuda.is_available():
        with torch.device("meta"):
            need = 4 * sum(p.numel() for p in Qwen3_5ForConditionalGeneration(cfg).parameters())
        if need > 0.9 * torch.cuda.mem_get_info()[0]:
            dtype = torch.bfloat16
            log(f"{need / 1e9:.0f} GB of float32 weights do not fit this card: drawing them in bf16")
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device()):
            model = Qwen3_5ForConditionalGeneration(cfg).to(torch.bfloat16).eval()
    finally:
        torch.set_default_dtype(default)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the float32 copy's blocks: an engine beside this model sizes from free memory
    if make_every_weight_count:
        # transformers starts the (1 + w) norms at 0 and dt_bias at 1: a loader that dropped the norm weights or
        # the bias would still match. Drawn like tiny_qwen3_5 does, so the check sees them.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight") and ".visual." not in name:
                    p.normal_(1.0 if ".linear_attn.norm." in name else 0.0, 0.3)
                elif name.endswith("dt_bias"):
                    p.normal_(0.0, 1.0)
    n = sum(p.numel() for p in model.parameters())
    log(f"built {cfg.text_config.num_hidden_layers}-layer model on {device()}: {n / 1e9:.2f} B parameters "
        f"in {time.time() - start:.1f}s")
    return model


def write_tokenizer(folder: str, vocab: int) -> None:
    """The anchor's word-level tokenizer: "t{i}" is token i, so a prompt of N words is N tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab)}, unk_token="t2"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##")
    PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="t0", eos_token="t1", unk_token="t2").save_pretrained(folder)


def save(model, folder: str) -> None:
    need = sum(p.numel() * p.element_size() for p in model.parameters()) + (64 << 20)  # + index, tokenizer
    os.makedirs(folder, exist_ok=True)
    st = os.statvfs(folder)
    if st.f_bavail * st.f_frsize < need:  # before minutes of writing, not after
        raise SystemExit(f"{folder}: {st.f_bavail * st.f_frsize / 1e9:.1f} GB free, the checkpoint needs "
                         f"{need / 1e9:.1f} GB; pick a folder on a larger filesystem")
    start = time.time()
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="5GB")
    size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors"))
    log(f"wrote {size / 1e9:.1f} GB of safetensors to {folder} in {time.time() - start:.1f}s")
    write_tokenizer(folder, model.config.text_config.vocab_size)  # last: its files mark a finished folder


def made(folder: str) -> bool:
    return all(os.path.exists(os.path.join(folder, f)) for f in ("config.json", "tokenizer.json"))


def make(folder: str, layers: int | None = None, tiny: bool = False) -> dict:
    if made(folder):
        log(f"{folder} already holds a checkpoint: kept")
        return {"folder": folder, "made": False}
    start = time.time()
    model = build(layers, tiny)
    n = sum(p.numel() for p in model.parameters())
    save(model, folder)
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    out = {"folder": folder, "made": True, "params_b": round(n / 1e9, 2), "s": round(time.time() - start, 1)}
    log(f"made {json.dumps(out)}")
    return out


# ---- check


def scratch_root(need: float) -> str:
    """/dev/shm when it has the room (tmpfs writes fast), else the temp folder on disk."""
    for root in ("/dev/shm", tempfile.gettempdir()):
        try:
            st = os.statvfs(root)
        except OSError:
            continue
        if st.f_bavail * st.f_frsize > need:
            return root
    return tempfile.gettempdir()


def chosen_logprobs(model, prompts: list[list[int]], outputs: list[list[int]]) -> list[tuple[list[float], list[int]]]:
    """transformers' forward over prompt + our tokens: per generated position, (logprob of our token, argmax)."""
    dev = next(model.parameters()).device
    rows = []
    with torch.inference_mode():
        for p, toks in zip(prompts, outputs, strict=True):
            logits = model(input_ids=torch.tensor([p + toks], device=dev)).logits[0].float()
            lp = torch.log_softmax(logits[len(p) - 1 : len(p) - 1 + len(toks)], -1)
            chosen = lp.gather(1, torch.tensor(toks, device=dev)[:, None]).squeeze(1)
            rows.append((chosen.tolist(), lp.argmax(-1).tolist()))
    return rows


def compare(ours: list[list[float]], outputs: list[list[int]], ref) -> dict:
    diffs, agree = [], 0
    for lp, toks, (ref_lp, ref_top) in zip(ours, outputs, ref, strict=True):
        diffs += [abs(a - b) for a, b in zip(lp, ref_lp, strict=True)]
        agree += sum(int(t == r) for t, r in zip(toks, ref_top, strict=True))
    return {"max_abs": max(diffs), "mean_abs": sum(diffs) / len(diffs), "top1_agree": agree / len(diffs),
            "positions": len(diffs)}


def within(s: dict) -> bool:
    return s["max_abs"] <= MAX_ABS and s["mean_abs"] <= MEAN_ABS and s["top1_agree"] >= MIN_AGREE


def broken_variants(model):
    """Bugs a hybrid model can have, made in transformers' copy: (name, undo) after each is applied."""
    layers = [m for n, m in model.named_modules() if n.endswith("linear_attn")]
    saved = {}

    def conv_without_state():  # only the current token's tap: the conv state is never read
        saved["conv"] = [m.conv1d.weight.detach().clone() for m in layers]
        for m in layers:
            m.conv1d.weight.data[..., :-1] = 0

    def decay_without_bias():
        saved["dt"] = [m.dt_bias.detach().clone() for m in layers]
        for m in layers:
            m.dt_bias.data.zero_()

    def fixed_write_gate():  # beta = sigmoid(0) = 0.5 everywhere
        saved["b"] = [m.in_proj_b.weight.detach().clone() for m in layers]
        for m in layers:
            m.in_proj_b.weight.data.zero_()

    def restore():
        for key, attr in (("conv", "conv1d"), ("b", "in_proj_b")):
            for m, w in zip(layers, saved.pop(key, []), strict=False):
                getattr(m, attr).weight.data.copy_(w)
        for m, w in zip(layers, saved.pop("dt", []), strict=False):
            m.dt_bias.data.copy_(w)

    for name, apply in (("conv ignores its state", conv_without_state), ("decay without dt_bias", decay_without_bias),
                        ("write gate fixed at 0.5", fixed_write_gate)):
        apply()
        yield name
        restore()


def check(tiny: bool = False, out_dir: str | None = None, compile_workers: int | None = COMPILE_WORKERS) -> dict:
    from pagefleet.worker import LLM, SamplingParams

    w = TINY if tiny else Workloads()
    cuda = torch.cuda.is_available()
    start = time.time()
    result: dict = {"thresholds": {"max_abs": MAX_ABS, "mean_abs": MEAN_ABS, "min_top1_agree": MIN_AGREE}}
    scratch = tempfile.mkdtemp(prefix="hybrid-check-", dir=scratch_root(12e9))
    try:
        model = build(4, tiny, make_every_weight_count=True)
        save(model, scratch)
        # --tiny runs fp32 on both sides: the tiny config's logits are far wider (init 0.2) than the real shape's,
        # so its bf16 noise is not what the limits are set for, and in fp32 the two must agree to rounding
        dtype = "float32" if tiny else "bfloat16"
        kw = dict(gpu_memory_fraction=0.5) if cuda else {}  # CPU: the engine's default KV bytes
        llm = LLM(scratch, dtype=dtype, max_model_len=w.max_model_len, max_num_seqs=16,
                  max_num_batched_tokens=w.check_chunk, seed=0, compile_workers=compile_workers, **kw)
        rng = random.Random(2)
        prompts = [[rng.randint(*w.token_range) for _ in range(n)] for n in w.check_lens]
        params = SamplingParams(temperature=0.0, max_tokens=17, min_tokens=17, ignore_eos=True, logprobs=0,
                                detokenize=False)
        outs = llm.generate(prompts, params)
        steps = llm.engine.stats().recent_steps
        result["engine"] = {"dtype": dtype, "steps": len(steps),
                            "mixed_steps": sum(bool(s.num_prefill_tokens and s.num_decode_tokens) for s in steps),
                            "max_prefill_tokens": max(s.num_prefill_tokens for s in steps),
                            "ssm_state_dtype": str(llm.engine.runner.state.ssm.dtype)}
        del llm
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        if dtype == "float32":  # the engine ran fp32 on the bf16 checkpoint's values: so does the reference
            model.float()
        toks = [o.outputs[0].token_ids for o in outs]
        ours = [[e.logprob for e in o.outputs[0].logprobs] for o in outs]
        ref = chosen_logprobs(model, prompts, toks)
        result["ours"] = s = compare(ours, toks, ref)
        result["passed"] = within(s)
        log(f"ours vs transformers ({dtype}): max |d logprob| {s['max_abs']:.4f}, mean {s['mean_abs']:.4f}, "
            f"top-1 agreement {s['top1_agree']:.3f} over {s['positions']} positions "
            f"(limits {MAX_ABS} / {MEAN_ABS} / {MIN_AGREE}; {result['engine']['mixed_steps']} mixed steps)")
        result["bugs"] = {}
        ref_lp = [r[0] for r in ref]
        for name in broken_variants(model):
            b = compare(ref_lp, toks, chosen_logprobs(model, prompts, toks))
            b["caught"] = not within(b)
            result["bugs"][name] = b
            log(f"  a bug for scale, '{name}' vs transformers: max {b['max_abs']:.3f}, mean {b['mean_abs']:.3f}, "
                f"top-1 agreement {b['top1_agree']:.3f} -> {'caught' if b['caught'] else 'NOT caught'}")
        del model
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    result["s"] = round(time.time() - start, 1)
    blind = [n for n, b in result["bugs"].items() if not b["caught"]]
    log(f"CHECK {'PASS' if result['passed'] else 'FAIL'}"
        + (f" (the thresholds do not catch: {', '.join(blind)})" if blind else " (every bug variant caught)")
        + f" in {result['s']}s")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "hybrid_check.json"), "w") as f:
            json.dump(result, f, indent=1)
    return result


# ---- run


def engine_picks(llm, init_s: float) -> dict:
    eng = llm.engine
    r, c = eng.runner, eng.config
    picks = {"max_num_seqs": c.max_num_seqs, "max_num_batched_tokens": c.max_num_batched_tokens,
             "max_model_len": eng.max_model_len, "kv_blocks": r.kv.num_blocks, "block_size": c.block_size,
             "kv_tokens": r.kv.num_blocks * c.block_size, "prefix_caching": c.enable_prefix_caching,
             "compile_workers": c.compile_workers, "init_s": round(init_s, 1),
             "init_split_s": {k: round(v, 1) for k, v in r.start_seconds.items()}}
    picks["weight_bytes"] = sum(p.numel() * p.element_size() for p in r.model.parameters())
    if r.state is not None:
        picks.update(state_slots=r.state.num_slots, snapshot_slots=r.state.num_snapshots,
                     state_gib=round(r.state.nbytes / 2**30, 2),
                     ssm_state_dtype=str(r.state.ssm.dtype).removeprefix("torch."))
    return picks


def run(folder: str, out_dir: str, tiny: bool = False, grpo_prompts: int = 16, only: list[str] | None = None,
        compile_workers: int | None = COMPILE_WORKERS, ssm_dtype: str = "auto") -> dict:
    from pagefleet.worker import LLM, SamplingParams
    from pagefleet.worker.executor.startup.gc_freeze import frozen_heap

    w = TINY if tiny else Workloads()
    os.makedirs(out_dir, exist_ok=True)
    results: dict = {"checkpoint": folder, "tiny": tiny, "workloads": asdict(w), "grpo_prompts": grpo_prompts,
                     "vllm_anchor": VLLM, "vllm_anchor_label": ANCHOR_LABEL, "figures": {}, "errors": {}}

    def dump():
        with open(os.path.join(out_dir, "hybrid_bench.json"), "w") as f:
            json.dump(results, f, indent=1)

    cuda = torch.cuda.is_available()
    kw = dict(dtype="bfloat16", gpu_memory_fraction=0.85) if cuda else dict(kv_cache_memory_bytes=64 << 20)
    kw.update(compile_workers=compile_workers, mamba_ssm_cache_dtype=ssm_dtype)
    log(f"engine on {folder}: max_model_len {w.max_model_len}, asking 1024 sequences and 16,384 batched tokens "
        f"(the anchor's), {kw}")
    start = time.perf_counter()
    # max_num_seqs as the anchor asked: the engine lowers it to the state slots that fit in the budget
    llm = LLM(folder, max_model_len=w.max_model_len, max_num_seqs=1024, max_num_batched_tokens=16384, seed=0, **kw)
    results["engine"] = picks = engine_picks(llm, time.perf_counter() - start)
    log(f"engine picked {json.dumps(picks)} ({ANCHOR_LABEL}: init {VLLM['init_s']} s)")
    dump()
    rng = random.Random(1)  # the anchor's prompt stream: warm-up, batch 1, then mixed 256 draw from it in order

    def tokens(n: int) -> list[int]:
        return [rng.randint(*w.token_range) for _ in range(n)]

    def go(reqs, temperature=0.0, n=1, seeded=False) -> dict:
        prompts = [tokens(p) for p, _ in reqs]
        params = [SamplingParams(n=n, max_tokens=o, min_tokens=o, ignore_eos=True, temperature=temperature,
                                 seed=i if seeded else None, detokenize=False) for i, (_, o) in enumerate(reqs)]
        llm.engine.block_manager.reset_prefix_cache()  # nothing from an earlier workload is cached
        with frozen_heap():
            t = time.perf_counter()
            outs = llm.generate(prompts, params)
            dt = time.perf_counter() - t
        got = sum(len(s.token_ids) for o in outs for s in o.outputs)
        want = n * sum(o for _, o in reqs)
        if got != want:
            raise RuntimeError(f"{got} output tokens, {want} asked (ignore_eos, min_tokens)")
        return {"requests": len(reqs), "n": n, "output_tokens": got, "s": round(dt, 3),
                "output_tok_per_s": round(got / dt, 1)}

    def figure(key: str, label: str, fn) -> None:
        if only and key not in only:
            return
        log(f"{label} ...")
        try:
            r = fn()
        except Exception as e:  # the rows after it still run: one GPU call is all there is
            traceback.print_exc()
            results["errors"][key] = f"{type(e).__name__}: {e}"
            log(f"{label}: FAILED {results['errors'][key]}")
            dump()
            return
        anchor = VLLM[key]
        r["label"], r["vllm_anchor"] = label, anchor
        r["ratio"] = round(r["output_tok_per_s"] / anchor, 3) if anchor else None
        results["figures"][key] = r
        beside = (f"{ANCHOR_LABEL}: {anchor} tok/s -> {r['ratio']:.2f}x" if anchor
                  else f"{ANCHOR_LABEL}: no figure for this row")
        log(f"{label}: {r['output_tok_per_s']} output tok/s ({r['output_tokens']} tokens in {r['s']}s); {beside}")
        dump()

    n_warm, warm_in, warm_out = w.warm
    go([(warm_in, warm_out)] * n_warm)  # untimed, as the anchor's: first-touch memory and kernels
    figure("batch1", f"batch 1, {w.batch1[0]} in / {w.batch1[1]} out, greedy", lambda: go([w.batch1]))
    if "batch1" in results["figures"]:  # each decode step reads every weight once: ANCHORS.md's copy rate bounds it
        bound = COPY_BYTES_PER_S / picks["weight_bytes"]
        results["figures"]["batch1"]["weights_bound_tok_per_s"] = round(bound, 1)
        log(f"batch 1 bound by the weights alone: {bound:.1f} tok/s ({picks['weight_bytes'] / 1e9:.2f} GB read per "
            f"step at {COPY_BYTES_PER_S / 1e12:.2f} TB/s; ANCHORS.md: ~79 for this shape)")
    n_mixed, seed, in_range, out_range = w.mixed
    random.seed(seed)
    mixed = [(random.randint(*in_range), random.randint(*out_range)) for _ in range(n_mixed)]
    results["workloads_drawn"] = {"mixed": mixed}
    figure("mixed256", f"mixed {n_mixed} (seed {seed}), greedy", lambda: go(mixed))
    go([(warm_in, warm_out)] * 2, temperature=1.0, n=2, seeded=True)  # the sampling path warmed, untimed
    figure("mixed256_t1", f"mixed {n_mixed} (seed {seed}), temperature 1", lambda: go(mixed, temperature=1.0))
    p_len, o_len, n = w.grpo
    figure("grpo", f"GRPO {grpo_prompts} prompts x n={n}, {p_len}/{o_len}, temperature 1, seeded",
           lambda: go([(p_len, o_len)] * grpo_prompts, temperature=1.0, n=n, seeded=True))
    n_big, seed, in_range, out_range = w.mixed2048
    random.seed(seed)
    big = [(random.randint(*in_range), random.randint(*out_range)) for _ in range(n_big)]
    results["workloads_drawn"]["mixed2048"] = big
    figure("mixed2048", f"mixed {n_big} (seed {seed}), greedy", lambda: go(big))
    table(results)
    return results


def table(results: dict) -> None:
    e = results["engine"]
    tiny = " (--tiny: tiny model and workloads, the anchor figures do not compare)" if results["tiny"] else ""
    lines = ["", f"pagefleet on {results['checkpoint']} beside the {ANCHOR_LABEL} (ANCHORS.md, 2026-12-01){tiny}",
             f"{'workload':<58} {'pagefleet':>12} {'vLLM anchor':>12} {'ratio':>7}"]
    for r in results["figures"].values():
        a = f"{r['vllm_anchor']:,.1f}" if r["vllm_anchor"] else "-"
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] else "-"
        lines.append(f"{r['label']:<58} {r['output_tok_per_s']:>12,.1f} {a:>12} {ratio:>7}")
    if "weights_bound_tok_per_s" in results["figures"].get("batch1", {}):
        lines.append(f"{'batch 1 ceiling: weight bytes / 4.27 TB/s (ANCHORS.md: ~79)':<58} "
                     f"{results['figures']['batch1']['weights_bound_tok_per_s']:>12,.1f}")
    lines.append(f"{'engine init, s':<58} {e['init_s']:>12} {VLLM['init_s']:>12}")
    lines.append(f"engine init split, s: {json.dumps(e['init_split_s'])} (vLLM: weights 13, torch.compile 65, "
                 f"profiling and warm-up 103, graphs 11)")
    lines.append(f"engine: max_num_seqs {e['max_num_seqs']}, batched tokens {e['max_num_batched_tokens']}, "
                 f"state slots {e.get('state_slots')} + {e.get('snapshot_slots')} snapshots "
                 f"({e.get('state_gib')} GiB, recurrent state {e.get('ssm_state_dtype')}), "
                 f"KV {e['kv_tokens']:,} tokens")
    print("\n".join(lines), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("dir")
    m.add_argument("--layers", type=int, default=None, help="layers of the cut (default: all 64)")
    c = sub.add_parser("check")
    c.add_argument("--out", default=None, help="folder for hybrid_check.json")
    r = sub.add_parser("run")
    r.add_argument("dir")
    r.add_argument("out")
    r.add_argument("--grpo-prompts", type=int, default=16, help="GRPO prompts of n=16 samples (the issue's: 64)")
    r.add_argument("--only", nargs="+", choices=["batch1", "mixed256", "mixed256_t1", "grpo", "mixed2048"],
                   default=None)
    r.add_argument("--mamba-ssm-cache-dtype", default="auto", choices=MAMBA_SSM_DTYPES,
                   help="the recurrent state's storage (auto: the checkpoint's mamba_ssm_dtype, else bf16; vLLM's "
                        "rule, so both engines store the same)")
    for s in (m, c, r):
        s.add_argument("--tiny", action="store_true", help="a tiny Qwen3.5 config and workloads (smoke test)")
    for s in (c, r):
        s.add_argument("--compile-workers", type=int, default=COMPILE_WORKERS,
                       help="the engine's start-up compile workers (-1: its auto choice; default 0: COMPILE_WORKERS)")
    args = p.parse_args(argv)
    workers = None if getattr(args, "compile_workers", 0) < 0 else getattr(args, "compile_workers", 0)
    if args.cmd == "make":
        make(args.dir, args.layers, args.tiny)
    elif args.cmd == "check":
        return 0 if check(args.tiny, args.out, workers)["passed"] else 1
    else:
        return run(args.dir, args.out, args.tiny, args.grpo_prompts, args.only, workers,
                   args.mamba_ssm_cache_dtype)["errors"] and 1 or 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
