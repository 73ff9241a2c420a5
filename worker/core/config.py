"""Engine settings, validated once at start-up (the flags that set them: entrypoints/engine_args.py)."""

from __future__ import annotations

from dataclasses import dataclass, replace

MAMBA_SSM_DTYPES = ("auto", "float32", "bfloat16", "float16")
# the paged KV cache's storage, vLLM's --kv-cache-dtype: auto is the model dtype; fp8 (= fp8_e4m3) halves its bytes
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


def batch_defaults(hopper: bool, serving: bool) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) as vLLM picks them (EngineArgs.get_batch_defaults): on a
    Hopper-class GPU 1024 sequences and 16,384 tokens offline, 8,192 for its API server; elsewhere 256 / 2,048."""
    if hopper:
        return 1024, 8192 if serving else 16384
    return 256, 2048


@dataclass
class EngineConfig:
    model: str | None = None  # HF checkpoint folder; None = the bundled SmolLM2-135M-Instruct
    dtype: str = "auto"  # auto: the checkpoint's dtype on GPU, float32 on CPU
    device: str = "auto"  # auto: cuda if available, else cpu
    max_model_len: int | None = None  # None: the model's max_position_embeddings, capped at 8192
    max_num_seqs: int | None = None  # sequences in one step; None: batch_defaults for the device
    max_num_batched_tokens: int | None = None  # token budget of one step (prefill chunks + decodes); None: auto
    # the most prompt tokens in a step that also decodes (core/scheduler.py); None: the whole token budget
    mixed_prefill_tokens: int | None = None
    serving: bool = False  # set by `pagefleet serve`: the batch defaults of vLLM's API server
    block_size: int = 16  # tokens per KV block
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # no CUDA graphs
    gpu_memory_fraction: float = 0.9  # share of the whole card this engine may use (weights + KV + activations)
    kv_cache_memory_bytes: int | None = None  # explicit KV budget; the default on CPU is 1 GiB
    num_gpu_blocks_override: int | None = None  # force the number of KV blocks (tests, benchmarks)
    quantization: str | None = None  # None or "fp8" (Hopper)
    kv_cache_dtype: str = "auto"  # KV_CACHE_DTYPES; fp8 halves each block, so twice the tokens fit the same budget
    # storage of a hybrid model's recurrent (Gated DeltaNet) state, vLLM's --mamba-ssm-cache-dtype: auto is the
    # checkpoint's mamba_ssm_dtype where its config names one, else the model dtype; the maths is fp32 either way
    mamba_ssm_cache_dtype: str = "auto"
    seed: int = 0
    # structured outputs: text the grammar forces (a JSON key, its quotes and colon) joins the output as tokens at
    # once and runs through the model as one chunk, not one step a token (SGLang's jump-forward); off by default,
    # since those tokens are xgrammar's longest-match split of the text, not always the tokenizer's own
    structured_outputs_jump_forward: bool = False
    async_scheduling: bool = True  # overlap decode steps: launch step N+1 before reading step N's tokens
    enable_lora: bool = False  # keep slots for LoRA adapters, loaded and unloaded while serving
    # weights and KV cache in memory that sleep() hands back to the driver and wake_up() maps again at the same
    # addresses (a trainer beside the engine; worker/executor/sleep.py)
    enable_sleep_mode: bool = False
    max_loras: int = 4  # adapters loaded at once
    max_lora_rank: int = 16
    # Processes compiling GPU kernels at a cold start (worker/executor/startup/compile_workers.py); None: auto, 0: none.
    compile_workers: int | None = None
    cpu_threads: int | None = None  # torch threads on CPU; default half the cores (server and tokenizer need the rest)
    # ranks of one model over the GPUs of one host (gloo ranks on CPU): a process per rank, executor/tensor_parallel.py
    tensor_parallel_size: int = 1

    def with_batch_defaults(self, hopper: bool) -> EngineConfig:
        """The config with max_num_seqs / max_num_batched_tokens left at None set for the device (once, at start)."""
        seqs, tokens = batch_defaults(hopper, self.serving)
        return replace(self, max_num_seqs=self.max_num_seqs or seqs,
                       max_num_batched_tokens=self.max_num_batched_tokens or tokens)

    def validate(self) -> EngineConfig:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        need(self.dtype in ("auto", "float32", "float16", "bfloat16"),
             f"dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}")
        need(self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"),
             f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        need(self.max_model_len is None or self.max_model_len > 0,
             f"max_model_len must be > 0, got {self.max_model_len}")
        need(self.max_num_seqs is None or self.max_num_seqs > 0, f"max_num_seqs must be > 0, got {self.max_num_seqs}")
        need(self.max_num_batched_tokens is None or self.max_num_batched_tokens > 0,
             f"max_num_batched_tokens must be > 0, got {self.max_num_batched_tokens}")
        need(self.mixed_prefill_tokens is None or self.mixed_prefill_tokens > 0,
             f"mixed_prefill_tokens must be > 0, got {self.mixed_prefill_tokens}")
        need(self.block_size in (8, 16, 32, 64, 128),
             f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        need(0.0 < self.gpu_memory_fraction <= 1.0,
             f"gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction}")
        need(self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0, "kv_cache_memory_bytes must be > 0")
        need(self.num_gpu_blocks_override is None or self.num_gpu_blocks_override > 0,
             "num_gpu_blocks_override must be > 0")
        need(self.quantization in (None, "fp8"), f"quantization must be fp8 or unset, got {self.quantization!r}")
        need(self.kv_cache_dtype in KV_CACHE_DTYPES,
             f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
             + (" (e5m2 is not supported: e4m3 keeps a bit more precision in the same byte)"
                if self.kv_cache_dtype == "fp8_e5m2" else ""))
        need(self.mamba_ssm_cache_dtype in MAMBA_SSM_DTYPES,
             f"mamba_ssm_cache_dtype must be one of {', '.join(MAMBA_SSM_DTYPES)}, got {self.mamba_ssm_cache_dtype!r}")
        need(self.max_loras > 0 and self.max_lora_rank > 0, "max_loras and max_lora_rank must be > 0")
        need(self.compile_workers is None or self.compile_workers >= 0,
             f"compile_workers must be >= 0, got {self.compile_workers}")
        need(self.tensor_parallel_size in (1, 2, 4, 8),
             f"tensor_parallel_size must be 1, 2, 4 or 8, got {self.tensor_parallel_size}")
        tp = self.tensor_parallel_size > 1
        need(not (tp and self.enable_sleep_mode), "sleep mode is not sharded yet: tensor_parallel_size must be 1 with "
                                                  "--enable-sleep-mode")
        need(not (self.enable_lora and self.quantization),
             "LoRA adapters run on bf16 / fp32 weights; drop --quantization to use them")
        return self
