"""Executor bring-up: the model on its device (norms folded, FP8), LoRA slots, the KV cache sized and bound, the
kernels warmed up and the CUDA graphs captured, in the order the memory sizing needs."""

from __future__ import annotations

import os
import time
from dataclasses import replace

import torch

from pagefleet.worker.core.config import MAMBA_SSM_DTYPES, EngineConfig
from pagefleet.worker.executor.kv_cache import KVCache
from pagefleet.worker.executor.memory import profile_peak_bytes, size_kv_cache
from pagefleet.worker.executor.sampler import Sampler
from pagefleet.worker.executor.sleep import SleepMode
from pagefleet.worker.executor.startup.warmup import warm_up
from pagefleet.worker.executor.state_cache import StateCache, is_stateful, slot_counts
from pagefleet.worker.executor.step_inputs import CASCADE_MIN_ROWS
from pagefleet.worker.models.layers import ops, parallel
from pagefleet.worker.models.loader import build_model
from pagefleet.worker.models.registry import ModelConfig

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_dtype(name: str, model_dtype: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32  # fastest and exact on CPU
    return _DTYPES.get(model_dtype, torch.bfloat16) if model_dtype != "float32" else torch.bfloat16


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The paged KV cache's dtype for --kv-cache-dtype. fp8 is e4m3 at scale 1.0 (vLLM's default where a checkpoint
    brings no k_scale / v_scale): keys and values past +-448 saturate."""
    if name == "auto":
        return model_dtype
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError(f"--kv-cache-dtype {name} needs a GPU with e4m3 conversions (compute capability 8.9 or "
                         f"newer: Ada, Hopper); this one is {torch.cuda.get_device_name(device)}")
    return torch.float8_e4m3fn


def use_device(config: EngineConfig, device: torch.device) -> None:
    """Seed the random weights, make the device current (or size the CPU thread pool), pick the kernels."""
    torch.manual_seed(config.seed)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        # Oversubscribed OpenMP threads spin and slow small GEMMs several-fold: leave cores free.
        torch.set_num_threads(config.cpu_threads or max(1, (os.cpu_count() or 2) // 2))
    ops.use_triton(device.type == "cuda")


def load_model(config: EngineConfig, model_config: ModelConfig, model_path, dtype: torch.dtype, device: torch.device):
    """The model with its weights (random ones for model_path None), norms folded where the decode graphs use
    them, quantised for --quantization fp8."""
    tp = parallel.get_tensor_parallel()
    model = build_model(parallel.shard_config(model_config, tp.size), model_path, dtype, device)
    # not under tensor parallelism: the folded decode path adds o_proj / down_proj into the stream inside their
    # GEMVs, before the all-reduce that must come first
    if (device.type == "cuda" and not config.enforce_eager and not config.enable_lora and tp.size == 1
            and dtype in (torch.bfloat16, torch.float16) and hasattr(model, "fold_norms")):
        # decode graphs then launch no per-layer norm (LlamaForCausalLM.forward_folded; the Qwen3.5 hybrid
        # has no folded path); before FP8
        # quantisation, so the scales cover the folded weights
        model.fold_norms()
    if config.quantization == "fp8":
        from pagefleet.worker.models.layers.fp8 import quantize_model_fp8

        quantize_model_fp8(model, device)
    return model


def bring_up(runner, model_path, compile_workers=None, compile_share: tuple[int, int] | None = None) -> None:
    """Give the runner (its config, model_config, max_model_len, device, dtype and block sizes set) its model,
    start_seconds, lora, sampler, kv and captured graphs. compile_workers: the running CompileWorkers, waited for
    once the weights are loaded. compile_share (i, n): a compile worker's slice of the warm-up steps and graph
    captures."""
    config, device = runner.config, runner.device
    use_device(config, device)
    start = time.time()
    runner.model = load_model(config, runner.model_config, model_path, runner.dtype, device)
    runner.sleep_mode = None
    if config.enable_sleep_mode:  # the weights move into their region before anything holds their addresses
        runner.sleep_mode = SleepMode(device)
        runner.sleep_mode.adopt_model(runner.model)
    # seconds of each start-up phase, for the engine's start-up line and a compile worker's report
    runner.start_seconds = {"load": time.time() - start, "workers": 0.0, "warmup": 0.0, "graphs": 0.0}
    if compile_workers is not None:
        # before the adapter slots, the state slots and the KV cache are allocated: the workers hold GPU memory
        # while they run (a Qwen3.6-27B-shape engine's state slots, tens of GB, are allocated at once), and the
        # KV budget is measured from free memory
        start = time.time()
        compile_workers.wait()
        runner.start_seconds["workers"] = time.time() - start
    runner.lora = None
    if config.enable_lora:  # before the KV cache is sized, so the budget counts the adapter slots
        from pagefleet.worker.models.layers.lora import LoRAManager

        runner.lora = LoRAManager(runner.model, config.max_loras, config.max_lora_rank, runner.dtype, device)
    runner.state = None
    if is_stateful(runner.model):  # before the KV cache is sized, so the budget counts the state slots
        config = runner.config = bring_up_state(runner, config, device)
    runner.sampler = Sampler(device, config.seed, runner.model_config.eos_token_ids, config.max_num_seqs)
    if compile_share is not None and compile_share[0] == 0 and device.type == "cuda":
        profile_peak_bytes(runner, config)  # a worker's blocks are fixed, but this step's kernels are the engine's
    shard = parallel.shard_config(runner.model_config, parallel.get_tensor_parallel().size)  # this rank's KV heads
    num_blocks = parallel.agree_min(size_kv_cache(runner, config, shard))  # every rank holds the same blocks
    runner.kv = KVCache(shard, num_blocks, runner.block_size, runner.kv_dtype, device,
                        len(runner.model.attention_layers()))
    if compile_share is None:  # the engine's own line, not a compile worker's
        scale = " at scale 1.0 (values past +-448 saturate)" if runner.kv_dtype == torch.float8_e4m3fn else ""
        print(f"pagefleet: KV cache: {num_blocks * runner.block_size:,} tokens in {num_blocks:,} blocks "
              f"({runner.kv.data.nbytes / 2**30:.2f} GiB, {str(runner.kv_dtype).removeprefix('torch.')}{scale})",
              flush=True)
    if runner.sleep_mode is not None:  # the KV cache moves into its region: freed first, so the peak is one cache
        shape, dtype = runner.kv.data.shape, runner.kv.data.dtype
        runner.kv.data = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
        runner.kv.data = runner.sleep_mode.allocate_kv(shape, dtype)
    runner.kv.bind(runner.model)
    # eager decode steps of many rows (past the decode graphs) read each prompt's shared blocks once a group
    runner.cascade_samples = ops.cascade_samples(shard.num_attention_heads, shard.num_key_value_heads) \
        if config.max_num_seqs >= CASCADE_MIN_ROWS else 0
    if device.type == "cuda":
        warm_up(runner, compile_share)
        if not config.enforce_eager:
            runner.cuda_graphs.capture(runner.model, device, config, runner.max_model_len, runner.max_blocks_per_seq,
                                       compile_share)
            runner.start_seconds["graphs"] = runner.cuda_graphs.capture_seconds
        if compile_workers is not None:
            compile_workers.mark_warm()


def ssm_state_dtype(flag: str, checkpoint: str | None, model_dtype: torch.dtype) -> tuple[torch.dtype, str]:
    """The recurrent state's storage dtype and why, by vLLM's rule: an explicit --mamba-ssm-cache-dtype wins, then
    the checkpoint's mamba_ssm_dtype, then the model dtype. bf16 halves a 27B slot (150 -> 75 MB) and the state
    traffic of a decode step, which at 256 sequences outweighs the weights."""
    if flag != "auto":
        return getattr(torch, flag), "--mamba-ssm-cache-dtype"
    if checkpoint:
        name = checkpoint.removeprefix("torch.")
        if name not in MAMBA_SSM_DTYPES[1:]:  # past "auto": the dtypes a state may be stored in
            raise ValueError(f"the checkpoint's mamba_ssm_dtype {checkpoint!r} is not float32, bfloat16 or float16")
        return getattr(torch, name), "the checkpoint's mamba_ssm_dtype"
    return model_dtype, "the model dtype: the checkpoint names no mamba_ssm_dtype"


def bring_up_state(runner, config: EngineConfig, device: torch.device) -> EngineConfig:
    """The state cache of a model with recurrent layers, allocated and bound: a slot per sequence the scheduler
    may run, and snapshot slots for the prefix cache. -> the config, max_num_seqs lowered to the slots that fit."""
    ssm_dtype, why = ssm_state_dtype(config.mamba_ssm_cache_dtype, runner.model_config.mamba_ssm_dtype, runner.dtype)
    print(f"pagefleet: recurrent state in {str(ssm_dtype).removeprefix('torch.')} ({why})", flush=True)
    shapes = runner.model.state_shapes(ssm_dtype)
    slots, snapshots = (parallel.agree_min(n) for n in slot_counts(runner, config, shapes))
    if slots < config.max_num_seqs:
        print(f"pagefleet: max_num_seqs lowered from {config.max_num_seqs} to {slots}: the state slots of more "
              f"sequences do not fit in memory", flush=True)
        config = replace(config, max_num_seqs=slots)
    runner.state = StateCache(shapes, slots, snapshots, device)
    runner.state.bind(runner.model)
    return config
