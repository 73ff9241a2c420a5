"""LLM: the offline API — prompts (text, token ids or chat messages) in, finished outputs out."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence as Seq

from tqdm import tqdm

from pagefleet.worker.core.config import EngineConfig
from pagefleet.worker.core.outputs import RequestOutput
from pagefleet.worker.core.sampling_params import SamplingParams
from pagefleet.worker.engine.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from pagefleet.worker.engine.llm_engine import LLMEngine


class LLM:
    def __init__(self, model: str | None = None, **engine_args):
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))
        self.engine.emit_partial = False
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def encode(self, prompt: str | list[int]) -> list[int]:
        return list(prompt) if not isinstance(prompt, str) else self.tokenizer(prompt).input_ids

    @functools.cached_property
    def _chat_template_variables(self) -> frozenset[str] | None:
        from pagefleet.worker.entrypoints.chat_template import template_variables

        return template_variables(self.tokenizer.chat_template)

    def chat_prompt_ids(self, messages: list[dict], add_generation_prompt: bool = True,
                        continue_final_message: bool = False, chat_template_kwargs: dict | None = None) -> list[int]:
        """The conversation through the chat template; ValueError for options it cannot take (as the server's 400)."""
        from pagefleet.worker.entrypoints.chat_template import prompt_options_error

        refused = prompt_options_error(self._chat_template_variables, add_generation_prompt, continue_final_message,
                                       chat_template_kwargs)
        if refused is not None:
            raise ValueError(refused[1])
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=continue_final_message,
                                                  **(chat_template_kwargs or {}))
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def generate(
        self,
        prompts: str | list[int] | Seq[str] | Seq[list[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora_name: str | None = None,
    ) -> list[RequestOutput]:
        """lora_name: an adapter loaded with load_lora, applied to every prompt of this call."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        all_params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(all_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(all_params)} sampling params")
        return self._run([self.encode(p) for p in prompts], all_params, use_tqdm, lora_name)

    def beam_search(self, prompts: str | list[int] | Seq[str] | Seq[list[int]],
                    params: BeamSearchParams, use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's LLM.beam_search: each prompt's beam_width best sequences (engine/beam_search.py), best first;
        a sequence's tokens hold the prompt and its text is the generated part. All prompts' beams step together."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        engine = self.engine
        searches = [BeamSearch(self.encode(p), params, engine.eos_token_ids, engine.max_model_len) for p in prompts]
        step = params.step_params()
        bar = tqdm(total=params.max_tokens, desc="beam search", unit="step", disable=not use_tqdm)
        while live := [s for s in searches if not s.done]:
            requests = [(s, tokens) for s in live for tokens in s.requests()]
            outputs = self._run([tokens for _, tokens in requests], [step] * len(requests), use_tqdm=False)
            tops = iter(out.outputs[0].logprobs[0].top for out in outputs)
            for s in live:
                s.advance([next(tops) for _ in s.live])
            bar.update()
        bar.close()
        decode = functools.partial(self.tokenizer.decode, skip_special_tokens=params.skip_special_tokens)
        return [BeamSearchOutput(s.results(decode)) for s in searches]

    def load_lora(self, name: str, path: str) -> None:
        """Load a PEFT LoRA folder under `name` (needs enable_lora=True)."""
        self.engine.load_lora(name, path)

    def load_lora_from_tensors(self, name: str, tensors, config: dict) -> None:
        """Load an adapter from tensors with PEFT names (a dict, pairs, or serialize_named_tensors' string) and
        its adapter_config fields (r, lora_alpha, ...), as SGLang's load_lora_adapter_from_tensors takes them."""
        self.engine.load_lora_from_tensors(name, tensors, config)

    def unload_lora(self, name: str) -> None:
        self.engine.unload_lora(name)

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes (they also end with this process)."""
        self.engine.shutdown()

    def sleep(self, level: int = 1) -> None:
        """Hand the GPU memory back (needs enable_sleep_mode=True): level 1 keeps the weights in host memory,
        level 2 drops them (load new ones with a weight update after wake_up)."""
        self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take the memory back: tags "weights" and / or "kv_cache" (None: both)."""
        self.engine.wake_up(tags)

    @property
    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping

    # ---- RL: weight updates in place, pause and resume (LLMEngine, engine/weight_updates.py)

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    @property
    def is_paused(self) -> bool:
        return self.engine.is_paused

    def update_weights_from_disk(self, path: str) -> int:
        return self.engine.update_weights_from_disk(path)

    def update_weights_from_tensor(self, named_tensors) -> int:
        return self.engine.update_weights_from_tensor(named_tensors)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str | None = None) -> None:
        self.engine.init_weights_update_group(master_address, master_port, rank_offset, world_size, group_name,
                                              backend)

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name: str | None = None) -> int:
        return self.engine.update_weights_from_distributed(names, dtypes, shapes, group_name)

    def pause(self, mode: str = "abort") -> list[RequestOutput]:
        return self.engine.pause(mode)

    def resume(self) -> None:
        self.engine.resume()

    def chat(self, conversations: list[dict] | list[list[dict]], params: SamplingParams | None = None,
             use_tqdm: bool = False, add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None):
        """add_generation_prompt, continue_final_message, chat_template_kwargs: as vLLM's LLM.chat (the last
        reaches the chat template as its variables, Qwen3's enable_thinking among them)."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        params = params or SamplingParams()
        ids = [self.chat_prompt_ids(c, add_generation_prompt, continue_final_message, chat_template_kwargs)
               for c in conversations]
        return self._run(ids, [params] * len(conversations), use_tqdm)

    def _run(self, prompt_ids: list[list[int]], params: list[SamplingParams], use_tqdm: bool,
             lora_name: str | None = None) -> list[RequestOutput]:
        if self.engine.is_paused:
            raise ValueError("the engine is paused: resume() it before generating")
        for ids, p in zip(prompt_ids, params, strict=True):  # check all before adding any, so a bad one adds nothing
            self.engine.check_request(ids, p, lora_name)
        order = []
        for ids, p in zip(prompt_ids, params, strict=True):
            request_id = f"offline-{next(self._ids)}"
            order.append(request_id)
            self.engine.add_request(request_id, ids, p, lora_name)
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(order), desc="generate", unit="req", disable=not use_tqdm)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
                    bar.update()
        bar.close()
        return [done[r] for r in order]
