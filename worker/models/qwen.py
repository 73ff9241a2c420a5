"""Qwen2/2.5 (q/k/v bias, set from the config) and Qwen3 (per-head q/k RMSNorm): Llama's layers with two switches."""

from pagefleet.worker.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qk_norm = False


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
