"""LLMEngine: requests, LoRA adapters and outputs around the one step path (step.py) over the scheduler,
block manager and model runner."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from pagefleet.worker.core.block_manager import BlockManager
from pagefleet.worker.core.config import EngineConfig
from pagefleet.worker.core.detokenizer import text_decoder, visible_text
from pagefleet.worker.core.outputs import CompletionOutput, RequestOutput
from pagefleet.worker.core.sampling_params import SamplingParams, bad_words_token_ids
from pagefleet.worker.core.scheduler import Scheduler
from pagefleet.worker.core.sequence import Sequence
from pagefleet.worker.core.state_slots import StateSlots
from pagefleet.worker.engine import stats as engine_stats
from pagefleet.worker.engine.stats import EngineStats, StepRecord
from pagefleet.worker.engine.step import PLACEHOLDER, PendingStep
from pagefleet.worker.engine.weight_updates import WeightUpdates, output_versions
from pagefleet.worker.executor.startup import compile_workers as precompile
from pagefleet.worker.models.loader import load_model_config, load_tokenizer, resolve_model_path

MAX_DEFAULT_MODEL_LEN = 8192


class EngineSleepingError(ValueError):
    """A request or step while the engine sleeps (or holds no weights since a level-2 sleep): the server answers
    503. A ValueError, so that every path that refuses a bad request refuses this one too."""


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]


class LLMEngine(WeightUpdates):
    def __init__(self, config: EngineConfig):
        start = time.perf_counter()
        self.config = config.validate()
        self.model_path = resolve_model_path(config.model)
        self.model_name = self.model_path.name
        self.model_config = load_model_config(self.model_path)
        limit = self.model_config.max_position_embeddings
        self.max_model_len = min(config.max_model_len or min(limit, MAX_DEFAULT_MODEL_LEN), limit)
        if config.max_model_len and config.max_model_len > limit:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's "
                             f"max_position_embeddings={limit}")
        # started before torch is imported, the tokenizer read and the weights loaded, all of which they overlap
        tp = config.tensor_parallel_size > 1
        if tp:  # a readable refusal before torch is imported or any process starts
            from pagefleet.worker.models.layers.parallel import check_tensor_parallel

            check_tensor_parallel(self.model_config, config.tensor_parallel_size)
        compile_workers = None if tp else precompile.start(config, self.model_path, self.model_config,
                                                            self.max_model_len)
        from pagefleet.worker.executor.model_runner import ModelRunner  # imports torch

        tokenizer_start = time.perf_counter()
        self.tokenizer = load_tokenizer(self.model_path)
        self.text_decoder = text_decoder(self.tokenizer)
        tokenizer_seconds = time.perf_counter() - tokenizer_start
        if tp:  # rank 0 here, a worker process per other rank (executor/tensor_parallel.py)
            from pagefleet.worker.executor.tensor_parallel import TensorParallelRunner

            self.runner = TensorParallelRunner(config, self.model_config, self.model_path, self.max_model_len)
        else:
            self.runner = ModelRunner(config, self.model_config, self.model_path, self.max_model_len, compile_workers)
        self.config = config = self.runner.config  # batch defaults resolved for the device
        if self.runner.device.type == "cuda":
            t = self.runner.start_seconds
            print(f"pagefleet: engine up in {time.perf_counter() - start:.1f}s: tokenizer {tokenizer_seconds:.1f}s, "
                  f"weights {t['load']:.1f}s, then compile workers {t['workers']:.1f}s, warm-up {t['warmup']:.1f}s, "
                  f"graphs {t['graphs']:.1f}s", flush=True)
        self.eos_token_ids = set(self.model_config.eos_token_ids or [self.tokenizer.eos_token_id])
        self.runner.sampler.eos_token_ids = sorted(self.eos_token_ids)
        self.block_manager = BlockManager(self.runner.kv.num_blocks, config.block_size, config.enable_prefix_caching,
                                          self._state_slots())
        mixed = getattr(self.runner, "mixed_graphs", None)  # its chunk count bounds a step's jump-forward chunks
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   mixed.max_chunks if mixed is not None else None, config.mixed_prefill_tokens)
        self.requests: dict[str, Request] = {}
        self.emit_partial = True  # the streaming engine wants every step's progress; offline runs only the final
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.jump_forward_tokens_total = 0  # of those, forced by a grammar and appended without a draw
        self.steps_total = 0
        self.recent_steps: deque[StepRecord] = deque(maxlen=2048)
        self.pending: PendingStep | None = None  # an overlapped step not yet read back
        self.weight_version = 0  # +1 per weight update (weight_updates.py)
        self.paused: str | None = None
        self.held: list[Sequence] = []  # arrived or not started while paused: scheduled on resume
        self.weight_groups: dict = {}
        self.structured = None  # the grammar compiler (engine/structured_output.py), made at the first structured one
        self._structured_lock = threading.Lock()

    def _state_slots(self) -> StateSlots | None:
        """The state slot pool of a model with recurrent layers, over the runner's state cache (None without)."""
        state = self.runner.state
        if state is None:
            return None
        if self.config.enable_prefix_caching and not state.num_snapshots:
            print("pagefleet: prefix caching is off for this model: no memory for its state snapshots", flush=True)
        return StateSlots(state.num_slots, state.num_snapshots)

    # ---- requests

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams, lora_name: str | None = None) -> None:
        """Raise ValueError for a request the engine cannot serve (callable from any thread)."""
        self.check_awake()
        params.validate(self.model_config.vocab_size)
        if params.bad_words and params.bad_words_token_ids is None:  # the words as this model's tokens, checked
            params.bad_words_token_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
            params.validate(self.model_config.vocab_size)
        if lora_name is not None and lora_name not in self.lora_names():
            raise ValueError(f"no LoRA adapter named {lora_name!r} is loaded")
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        state = self.block_manager.state
        if state is not None and params.n > state.num_slots:
            raise ValueError(f"n={params.n} samples need a state slot each, but this model has {state.num_slots} "
                             f"(max_num_seqs)")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_token_ids)} tokens but max_model_len is {self.max_model_len} "
                f"(prompt plus at least one generated token must fit)"
            )
        if params.structured is not None:
            # parsed here (a bad one is a ValueError) and compiling from now on, cached for add_request
            self.structured_outputs().state(params.structured)

    def structured_outputs(self):
        """The grammar compiler, made at the first structured request (callable from any thread); from then on
        the sampler asks it for each step's bitmask."""
        if self.structured is None:
            with self._structured_lock:
                if self.structured is None:
                    from pagefleet.worker.engine.structured_output import StructuredOutputs  # imports xgrammar

                    structured = StructuredOutputs(self.tokenizer, self.model_config.vocab_size,
                                                   sorted(self.eos_token_ids),
                                                   jump_forward=self.config.structured_outputs_jump_forward)
                    self.runner.sampler.grammar_bitmask = structured.bitmask
                    self.structured = structured
        return self.structured

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    lora_name: str | None = None) -> None:
        self.check_request(prompt_token_ids, params, lora_name)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seed = params.seed
        parent = Sequence(request_id, 0, list(prompt_token_ids), len(prompt_token_ids), params, seed)
        if lora_name is not None:
            parent.lora_id = self.runner.lora.id_of[lora_name]
        parent.pending_forks = params.n - 1  # the other samples split off once the shared prompt is done
        if params.structured is not None:
            parent.grammar = self.structured.state(params.structured)  # compiles on the pool; the queue waits aside
            self.structured.live += 1
        self.requests[request_id] = Request(request_id, list(prompt_token_ids), params, [parent])
        parent.weight_versions = [(self.weight_version, 0)]
        (self.held.append if self.paused is not None else self.scheduler.add)(parent)
        self.prompt_tokens_total += len(prompt_token_ids)

    def abort_request(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        for seq in request.seqs:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self._finish(seq)

    # ---- LoRA adapters (between steps: the async engine calls these on its loop thread)

    def lora_names(self) -> list[str]:
        return self.runner.lora.names if self.runner.lora is not None else []

    def lora_paths(self) -> dict[str, str]:
        """Loaded adapter -> the folder it was loaded from."""
        return dict(self.runner.lora.path_of) if self.runner.lora is not None else {}

    def load_lora(self, name: str, path: str) -> None:
        if self.runner.lora is None:
            raise ValueError("LoRA adapters are off: start the engine with enable_lora (--enable-lora)")
        self.runner.lora.load(name, path)

    def load_lora_from_tensors(self, name: str, tensors, config: dict) -> None:
        """An adapter from a trainer's tensors: a dict or (name, tensor) pairs with PEFT names, or the string of
        weight_transfer.serialize_named_tensors (CUDA IPC handles), and its adapter_config fields."""
        if self.runner.lora is None:
            raise ValueError("LoRA adapters are off: start the engine with enable_lora (--enable-lora)")
        from pagefleet.worker.executor.weight_transfer import deserialize_named_tensors, named_list

        pairs = deserialize_named_tensors(tensors) if isinstance(tensors, str) else named_list(tensors)
        self.runner.lora.load_tensors(name, dict(pairs), config)

    def unload_lora(self, name: str) -> None:
        if self.runner.lora is None or name not in self.runner.lora.names:
            raise ValueError(f"no LoRA adapter named {name!r} is loaded")
        lora_id = self.runner.lora.id_of[name]
        users = sum(any(s.lora_id == lora_id for s in r.seqs) for r in self.requests.values())
        if users:
            raise ValueError(f"LoRA adapter {name!r} is in use by {users} request(s); unload it when they finish")
        self.runner.lora.unload(name)

    # ---- sleep mode: the weights' and KV cache's GPU memory handed to a trainer beside the engine and taken back
    # (executor/sleep.py); the CUDA graphs stay captured

    _dropped_at_version: int | None = None  # weight_version when wake_up mapped zeroed weights after level 2

    @property
    def is_sleeping(self) -> bool:
        return self.runner.is_sleeping

    def sleep(self, level: int = 1) -> None:
        """level 1: the weights to pinned host memory and the KV cache freed; level 2: both freed, and after
        wake_up the weights are zeros until a weight update (update_weights_from_disk / _tensor / _distributed),
        as vLLM's level 2 expects the trainer to push its weights. Refused while requests are in flight (as SGLang
        does: pause(mode="abort") or pause(mode="wait") first); the prefix cache is dropped with the KV cache."""
        self.runner.check_sleep(level)
        if self.requests:
            raise ValueError(f"cannot sleep with {len(self.requests)} request(s) in flight: let them finish, abort "
                             f"them or pause(mode='abort' | 'wait') first")
        if self.pending is not None:  # a step of aborted requests still on the device: its tokens are dropped
            self.pending, step = None, self.pending
            self._resolve(step)
        self.runner.sleep(level)
        self.block_manager.reset_prefix_cache()

    def wake_up(self, tags: list[str] | None = None) -> None:
        """tags: "weights" and / or "kv_cache" (None: both); the engine serves again once both are awake."""
        woken = self.runner.wake_up(tags)
        if "weights" in woken and self.runner.sleep_mode.level == 2:
            self._dropped_at_version = getattr(self, "weight_version", 0)

    def check_awake(self) -> None:
        """EngineSleepingError while asleep or while the weights are the zeros a level-2 wake-up left."""
        if self.runner.is_sleeping:
            raise EngineSleepingError(f"the engine is asleep ({' and '.join(sorted(self.runner.sleep_mode.asleep))} "
                                      f"released): call wake_up first")
        if self._dropped_at_version is not None:
            if getattr(self, "weight_version", 0) == self._dropped_at_version:
                raise EngineSleepingError("the weights were dropped by sleep(level=2): load new ones "
                                          "(update_weights_from_disk, _from_tensor or _from_distributed) first")
            self._dropped_at_version = None

    def step(self) -> list[RequestOutput]:
        self.check_awake()
        return super().step()

    def has_unfinished_requests(self) -> bool:
        """While paused: only when something is left to step (pause("wait") draining)."""
        return bool(self.requests) and (self.paused is None or (self.paused != "keep" and self.in_flight() > 0))

    # ---- outputs

    def _outputs(self, touched: dict[str, Request]) -> list[RequestOutput]:
        outputs = []
        for request in touched.values():
            finished = all(s.is_finished for s in request.seqs) and len(request.seqs) == request.params.n
            if not finished and not self.emit_partial:
                continue
            outputs.append(self.make_output(request, finished))
            if finished:
                self.requests.pop(request.request_id, None)
        return outputs

    def make_output(self, request: Request, finished: bool) -> RequestOutput:
        completions = []
        for seq in request.seqs:
            text = visible_text(seq) if seq.params.detokenize else ""
            ids = seq.output_token_ids
            if ids and ids[-1] == PLACEHOLDER:  # still on the device: reported with the next step
                ids = ids[:-1]
            completions.append(CompletionOutput(seq.index, text, ids, seq.finish_reason,
                                                list(seq.logprobs) if seq.logprobs is not None else None,
                                                seq.stop_reason, list(seq.weight_versions)))
        version, versions = output_versions(request.seqs, [len(c.token_ids) for c in completions])
        parent = request.seqs[0]
        prompt_logprobs = None
        if parent.prompt_logprobs is not None and not parent.needs_prompt_logprobs:  # every prompt token scored
            prompt_logprobs = [None, *parent.prompt_logprobs]
        return RequestOutput(request.request_id, request.prompt_token_ids, completions, finished,
                             request.seqs[0].num_cached_tokens, version, versions, prompt_logprobs)

    def shutdown(self) -> None:
        """Stop the processes beside the engine (tensor-parallel workers); the engine runs no step after it."""
        stop = getattr(self.runner, "shutdown", None)
        if stop is not None:
            stop()

    # ---- observability

    def kv_waste(self) -> tuple[int, int]:
        """(used slots, allocated slots) over the running sequences."""
        return self.block_manager.slot_usage(self.scheduler.running)

    def stats(self) -> EngineStats:
        return engine_stats.collect(self)
