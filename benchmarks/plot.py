"""Plots for docs/benchmarks.md from the JSON the GPU benchmarks wrote (docs/results/)."""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# vLLM 0.26.0 and transformers 5.17 on the same H200 (the shared anchors), output tok/s
VLLM_STATIC = {1: 198.8, 8: 1334, 64: 6595, 128: 8527, 256: 9864}
HF_STATIC = {1: 15.7, 8: 142, 64: 1110, 128: 2052}
VLLM_SERVE = {1: 195, 4: 721, 8: 1308, 16: 2216, 32: 3420, 64: 4478}
# the runs plotted (docs/benchmarks.md): static batches from run R, serving from run V (the latest of each,
# bf16 and FP8 on one machine in both)


def load(results: Path, name: str) -> dict | list:
    return json.loads((results / f"h200-run-{name}.json").read_text())


def main(results: Path, out: Path) -> None:
    run = load(results, "r")
    bf16_static = run["call3_main"]["static"]
    fp8 = run["call5_main_offline"]["fp8"]
    serve = load(results, "v")["call_1"]
    bf16_serve, fp8_serve = serve["serve_bf16"], serve["serve_fp8"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    batches = [1, 8, 64, 128, 256]
    x = range(len(batches))
    w = 0.2
    a.bar([i - 1.5 * w for i in x], [HF_STATIC.get(bs, 0) for bs in batches], w, label="transformers 5.17")
    a.bar([i - 0.5 * w for i in x], [VLLM_STATIC[bs] for bs in batches], w, label="vLLM 0.26 (bf16)")
    a.bar([i + 0.5 * w for i in x], [bf16_static[str(bs)]["output_tok_per_s"] for bs in batches], w,
          label="pagefleet bf16")
    a.bar([i + 1.5 * w for i in x], [fp8[f"static_{bs}"]["output_tok_per_s"] for bs in batches], w,
          label="pagefleet FP8")
    a.set_xticks(list(x), [str(bs) for bs in batches])
    a.set_xlabel("batch (512 in; 128 out at 1-8, 256 out at 64-256)")
    a.set_ylabel("output tok/s")
    a.set_title("Static batches, Llama-3.1-8B shape, one H200")
    a.legend()
    conc = [r["concurrency"] for r in bf16_serve]
    b.plot(conc, [VLLM_SERVE[c] for c in conc], "o-", label="vLLM 0.26 serve (bf16)")
    b.plot(conc, [r["output_tok_s"] for r in bf16_serve], "o-", label="pagefleet serve bf16")
    b.plot([r["concurrency"] for r in fp8_serve], [r["output_tok_s"] for r in fp8_serve], "o-",
           label="pagefleet serve FP8")
    b.set_xscale("log", base=2)
    b.set_xlabel("concurrency (564 in / 128 out, streaming)")
    b.set_ylabel("output tok/s")
    b.set_title("Serving, same H200 (run V)")
    b.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    root = Path(__file__).resolve().parent.parent
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else root / "docs" / "results", Path(sys.argv[2]) if len(sys.argv) > 2 else root / "docs" / "h200.png")
