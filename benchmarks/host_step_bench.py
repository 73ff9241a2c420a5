"""Host cost of the engine's bookkeeping in one decode step, on CPU: everything a step does but the forward.

On the GPU a decode step's forward is one graph replay; what the engine thread does around it (schedule,
step arrays, sampling, appending tokens, detokenising, outputs) must stay well under the step itself. This
runs a tiny model's engine with the forward replaced by ready logits (greedy onto a word token, so text
grows as in real output) over N sequences, and prints ms per step with the text decoded through
tokenizer.decode and through the Rust tokenizer directly (worker/core/detokenizer.py), alternating, each in a
fresh engine. With `special`, greedy lands on a special token instead (EOS after EOS under ignore_eos):
text stops growing, and the old decoder's windows grew by a token a step.
Usage: python benchmarks/host_step_bench.py [sequences] [steps] [special]
"""

import sys
import tempfile
import time
from pathlib import Path

import torch

from pagefleet.worker import SamplingParams
from pagefleet.worker.entrypoints.cli.bench_serve import write_word_tokenizer
from pagefleet.worker.core.config import EngineConfig
from pagefleet.worker.core.detokenizer import TextDecoder
from pagefleet.worker.engine.llm_engine import LLMEngine

VOCAB = 2048


def tiny_model(folder: Path) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    if not (folder / "config.json").exists():
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
        LlamaForCausalLM(config).save_pretrained(folder)
        write_word_tokenizer(str(folder))
    return str(folder)


def ms_per_step(model: str, seqs: int, steps: int, decoder: str, token: int) -> float:
    eng = LLMEngine(EngineConfig(model=model, device="cpu", max_model_len=2048, max_num_seqs=256,
                                 max_num_batched_tokens=8192, kv_cache_memory_bytes=2**28))
    eng.emit_partial = True  # the server streams every token
    if decoder == "tokenizer.decode":
        eng.text_decoder = TextDecoder(lambda ids, skip: eng.tokenizer.decode(ids, skip_special_tokens=skip))
    logits = torch.zeros(256, VOCAB)
    logits[:, token] = 1.0
    runner = eng.runner

    def ready_logits(batch, feed=None):
        rows = runner.prepare(batch)[4]
        return logits[: len(rows)] if rows else None

    runner.run = ready_logits
    for i in range(seqs):
        eng.add_request(f"r{i}", list(range(100, 664)), SamplingParams(temperature=0.0, max_tokens=10**6, ignore_eos=True))
    for _ in range(steps // 2):  # the prompts, then decodes at full length
        eng.step()
    start = time.perf_counter()
    for _ in range(steps):
        eng.step()
    return (time.perf_counter() - start) / steps * 1e3


def main():
    seqs = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 300
    special = len(sys.argv) > 3 and sys.argv[3] == "special"
    token = 0 if special else 5  # "t0" is the word tokenizer's special token; "t5" a word
    model = tiny_model(Path(tempfile.gettempdir()) / "pagefleet-host-step-model")
    rows = {"tokenizer.decode": [], "Rust tokenizer": []}
    for turn in range(3):
        for decoder in rows:
            rows[decoder].append(ms_per_step(model, seqs, steps, decoder, token))
            print(f"turn {turn + 1}, {decoder}: {rows[decoder][-1]:.3f} ms a step", flush=True)
    what = "a special token" if special else "a word"
    print(f"\n| text decoded through | ms per step, {seqs} sequences, greedy onto {what} (3 turns) |\n|---|---|")
    for decoder, ms in rows.items():
        print(f"| {decoder} | {', '.join(f'{x:.3f}' for x in ms)} |")


if __name__ == "__main__":
    main()
