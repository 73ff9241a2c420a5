"""benchmarks/fp8_quality.py on CPU: --quantization fp8's linears, run through the references on the bundled
trained model, keep its next-token choices close to fp32's along fp32's own greedy paths (H200-free: the
kernels are checked against these references elsewhere). A scale applied to the wrong side fails the check."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import fp8_quality  # noqa: E402

PROMPTS, TOKENS = fp8_quality.PROMPTS[:4], 16


@pytest.fixture(scope="module")
def reference(smollm2_path):
    llm = fp8_quality.new_llm(str(smollm2_path), "float32")
    ids, paths = fp8_quality.greedy_paths(llm, PROMPTS, TOKENS)
    return llm, ids, paths, fp8_quality.teacher_forced(llm, ids, paths)


def test_fp8_keeps_the_trained_models_choices(reference, smollm2_path):
    llm, ids, paths, ref = reference
    same = fp8_quality.compare(ref, ref)
    assert (same["top1_agreement"], same["max"], same["positions"]) == (1.0, 0.0, len(PROMPTS) * TOKENS)
    fp8 = fp8_quality.new_llm(str(smollm2_path), "float32")
    fp8_quality.quantize(fp8, "w8a8")
    r = fp8_quality.compare(ref, fp8_quality.teacher_forced(fp8, ids, paths))
    print(r)
    assert r["top1_agreement"] >= 0.85 and r["mean"] <= 0.2


def test_a_misapplied_scale_fails_it(reference, smollm2_path):
    from pagefleet.worker.models.layers.fp8 import Fp8Linear

    llm, ids, paths, ref = reference
    fp8 = fp8_quality.new_llm(str(smollm2_path), "float32")
    fp8_quality.quantize(fp8, "w8a8")
    for module in fp8.engine.runner.model.modules():
        if isinstance(module, Fp8Linear):  # each channel scaled by another channel's scale
            module.weight_scale.data = module.weight_scale.data.roll(1)
    r = fp8_quality.compare(ref, fp8_quality.teacher_forced(fp8, ids, paths))
    print(r)
    assert r["top1_agreement"] < 0.85 or r["mean"] > 0.2
