"""Sampling: reference.sample against the exact distributions of its semantics (chi-square), its thresholds on
ties, the counter-based noise; the Triton kernel compiled for Hopper, and against the reference under the
Triton interpreter (test_sampling_triton.py, run from here in a child process, as test_kernels.py does)."""

import math

import numpy as np
import pytest
import torch

import interpreter
from pagefleet.kernels import reference as ref


def records(temperature, top_k=0, top_p=1.0, min_p=0.0, seed=0, position=0, rows=None) -> torch.Tensor:
    """Row records (reference.py's layout): each argument a scalar or one value per row."""
    n = rows or max(len(v) if isinstance(v, (list, tuple, np.ndarray)) else 1
                    for v in (temperature, top_k, top_p, min_p, seed, position))

    def col(v):
        return list(v) if isinstance(v, (list, tuple, np.ndarray)) else [v] * n

    rec = np.zeros((n, ref.SAMPLE_FIELDS), dtype=np.int32)
    f = rec.view(np.float32)
    f[:, ref.INV_TEMPERATURE] = [0.0 if t == 0 else 1.0 / t for t in col(temperature)]
    rec[:, ref.TOP_K] = col(top_k)
    f[:, ref.TOP_P] = col(top_p)
    f[:, ref.LOG_MIN_P] = [math.log(m) if m > 0 else -math.inf for m in col(min_p)]
    seeds = np.array([int(s) % 2**64 for s in col(seed)], dtype=np.uint64)
    rec[:, ref.SEED_LO] = (seeds & np.uint64(0xFFFFFFFF)).astype(np.uint32).view(np.int32)
    rec[:, ref.SEED_HI] = (seeds >> np.uint64(32)).astype(np.uint32).view(np.int32)
    rec[:, ref.POSITION] = np.array(col(position), dtype=np.int64).astype(np.uint32).view(np.int32)
    return torch.from_numpy(rec)


def exact_distribution(logits, temperature, top_k=0, top_p=1.0, min_p=0.0) -> torch.Tensor:
    """The semantics, written plainly in float64 over one row: temperature, then top-k (ties at the k-th value
    kept), then top-p on the renormalised survivors (a token stays while the survivors strictly above it hold
    less than top_p), then min-p against the top probability; softmax over what is left."""
    x = (logits.float() * np.float32(1.0 / temperature)).double()
    keep = torch.ones_like(x, dtype=torch.bool)
    if 0 < top_k < len(x):
        keep &= x >= x.sort(descending=True).values[top_k - 1]
    if top_p < 1.0:
        e = torch.where(keep, torch.exp(x - x.max()), 0.0)
        above = torch.stack([e[x > v].sum() for v in x])
        keep &= above < top_p * e.sum()
    if min_p > 0:
        keep &= torch.softmax(x, 0) >= min_p * torch.softmax(x, 0).max()
    return torch.where(keep, torch.softmax(torch.where(keep, x, -math.inf), 0), 0.0)


def chi_square_p(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """p-value of the counts under the expected probabilities (cells with probability 0 must stay empty)."""
    assert counts[expected == 0].sum() == 0, "drew a token the semantics exclude"
    live = expected > 0
    n = counts.sum()
    e = expected[live] * n
    stat = ((counts[live] - e) ** 2 / e).sum()
    df = int(live.sum()) - 1
    return 1.0 if df == 0 else float(torch.special.gammaincc(torch.tensor(df / 2.0), stat / 2.0))


LOGITS = torch.tensor([2.0, 1.5, 1.4, 0.9, 0.3, 0.0, -0.2, -0.7, -1.1, -2.0, -3.0, -4.5])
CASES = [  # temperature, top_k, top_p, min_p
    (1.0, 0, 1.0, 0.0), (0.6, 0, 1.0, 0.0), (1.7, 0, 1.0, 0.0),
    (1.0, 4, 1.0, 0.0), (1.0, 0, 0.7, 0.0), (1.0, 0, 1.0, 0.15),
    (0.8, 6, 0.9, 0.05),
]


@pytest.mark.parametrize("case", CASES)
def test_reference_draws_the_exact_distribution(case):
    """20,000 draws of one row (one seed, output positions 0 ... 19,999) against the exact distribution."""
    temperature, top_k, top_p, min_p = case
    n = 20_000
    rows = LOGITS.repeat(n, 1)
    tokens = ref.sample(rows, records(temperature, top_k, top_p, min_p, seed=1234, position=np.arange(n)))
    counts = torch.bincount(tokens, minlength=len(LOGITS)).double()
    expected = exact_distribution(LOGITS, temperature, top_k, top_p, min_p)
    assert chi_square_p(counts, expected) > 1e-3, (counts / n, expected)


def test_ties_at_a_threshold_all_stay():
    """Top-k 2 over four equal top logits keeps all four; top-p 0.3 keeps the whole tied group though two of
    its four would reach 0.3; min-p keeps a token exactly at the floor."""
    x = torch.tensor([1.0, 5.0, 5.0, 0.0, 5.0, 5.0, -1.0, 2.0])
    n = 4000
    for top_k, top_p in ((2, 1.0), (0, 0.3)):
        tokens = ref.sample(x.repeat(n, 1), records(1.0, top_k, top_p, seed=5, position=np.arange(n)))
        assert set(tokens.tolist()) == {1, 2, 4, 5}
    y = torch.tensor([0.0, math.log(0.25), -3.0])  # p1 / p0 = 0.25 exactly in the log domain
    tokens = ref.sample(y.repeat(n, 1), records(1.0, min_p=0.25, seed=5, position=np.arange(n)))
    assert set(tokens.tolist()) == {0, 1}


def test_greedy_rows_are_left_alone_and_a_row_is_its_own():
    """inv_temperature 0 rows keep `out`; a row's draw depends only on its own record and logits."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 300, generator=g)
    rec = records([1.0, 0.0, 0.8, 1.2, 0.0], [0, 0, 7, 0, 0], [1.0, 1.0, 0.9, 0.5, 1.0], seed=[3, 4, 5, 6, 7],
                  position=[0, 1, 2, 3, 4])
    out = ref.sample(x, rec, torch.full((5,), -9, dtype=torch.int64))
    assert out[1] == out[4] == -9 and (out[[0, 2, 3]] >= 0).all()
    for i in (0, 2, 3):
        assert ref.sample(x[i:i + 1], rec[i:i + 1])[0] == out[i]


def test_counter_uniform_is_uniform_and_keyed():
    tokens = torch.arange(50_000)
    u = ref.counter_uniform(torch.tensor([7]), torch.tensor([0]), torch.tensor([3]), tokens)[0]
    assert u.dtype == torch.float32 and 0 < u.min() and u.max() < 1
    counts = torch.histc(u.double(), bins=20, min=0, max=1)
    assert chi_square_p(counts, torch.full((20,), 1 / 20, dtype=torch.float64)) > 1e-3
    again = ref.counter_uniform(torch.tensor([7, 8, 7, -1]), torch.tensor([0, 0, 1, -1]),
                                torch.tensor([3, 3, 3, 3]), tokens)
    assert torch.equal(again[0], u)
    for other in again[1:]:  # another seed word, another high word, the top bits: other noise
        assert (other == u).float().mean() < 1e-3
    nxt = ref.counter_uniform(torch.tensor([7]), torch.tensor([0]), torch.tensor([4]), tokens)[0]
    assert (nxt == u).float().mean() < 1e-3
    assert abs(float(torch.corrcoef(torch.stack([u, nxt]))[0, 1])) < 0.02


def test_unit_float_stays_strictly_inside_0_1_at_the_extreme_hashes():
    # a draw of exactly 1.0 scores +inf (its token wins whatever its probability), one of 0.0 scores -inf
    u = ref.unit_float(torch.tensor([0, 511, 512, 2**32 - 512, 2**32 - 1]))
    assert u.dtype == torch.float32 and bool((u > 0).all()) and bool((u < 1).all())
    assert float(u[-1]) == 1 - 2**-24 and float(u[0]) == 2**-24


@pytest.mark.parametrize("dtype, fold", [("*bf16", 1), ("*fp32", 1), ("*bf16", 4)])
def test_kernel_compiles_for_hopper_without_fma(dtype, fold):
    """The kernel through Triton's whole CUDA pipeline for sm_90 (PTX and cubin, no GPU needed): the
    interpreter does not check types as the compiler does. No FMA: x * inv_t - max rounds as the reference's; no
    register spills (local memory) with the candidate buffer's sort in registers."""
    pytest.importorskip("triton")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pagefleet.kernels.sampling import CAP, PIVOTS, SMALL, _sample_kernel

    sig = {"logits_ptr": dtype, "stride_row": "i32", "params_ptr": "*i32", "paramsf_ptr": "*fp32",
           "stride_params": "i32", "out_ptr": "*i64", "V": "i32", "work_ptr": "*i32", "BLOCK": "constexpr",
           "SEARCH_BLOCK": "constexpr", "NP": "constexpr", "CAP": "constexpr", "SMALL": "constexpr",
           "FOLD": "constexpr"}
    src = ASTSource(fn=_sample_kernel, signature=sig, constexprs={"BLOCK": 1024, "SEARCH_BLOCK": 256, "NP": PIVOTS,
                                                                  "CAP": CAP, "SMALL": SMALL, "FOLD": fold})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8,
                                                                             "enable_fp_fusion": False})
    ptx = compiled.asm["ptx"]
    assert compiled.asm["cubin"] and "fma.rn.f32" not in ptx and "ld.local" not in ptx


@pytest.mark.parametrize("dtype", ["*bf16", "*fp32"])
def test_split_kernels_compile_for_hopper_without_fma(dtype):
    """The split path's kernels (sampling_split.py), every pass's variant, through the CUDA pipeline for sm_90: no
    FMA (x * inv_t and x - max round as the reference's), no register spills."""
    pytest.importorskip("triton")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pagefleet.kernels import sampling_split as split

    row = {"params_ptr": "*i32", "paramsf_ptr": "*fp32", "stride_params": "i32", "V": "i32", "st_ptr": "*i32",
           "stf_ptr": "*fp32"}
    chunk = {"logits_ptr": dtype, "stride_row": "i32"}
    race = {"val_ptr": "*fp32", "idx_ptr": "*i32", "mass_ptr": "*fp32", "n_chunks": "i32"}
    nb = 1 << split.BITS
    variants = []
    for top_k, top_p in ((False, False), (False, True), (True, True)):  # the sampler's launch classes
        for first in (True, False):
            if top_k or first:  # the max pass alone (FIRST) without top-k
                flags = {"NB": nb, "SHIFT": 24 if first else 16, "BITS": split.BITS, "FIRST": first,
                         "WITH_MAX": first and top_p, "HAS_K": top_k}
                variants.append((split._hist_kernel, {**chunk, **row, "cmax_ptr": "*fp32", "hist_ptr": "*i32",
                                                      "n_chunks": "i32"}, {"CHUNK": split.CHUNK, **flags}))
                flags.pop("BITS")
                variants.append((split._select_kernel, {**row, "cmax_ptr": "*fp32", "hist_ptr": "*i32",
                                                        "n_chunks": "i32"}, {"CBLOCK": 128, "CTILE": 16, **flags}))
            if top_p or first:
                flags = {"FIRST": first, "HAS_K": top_k, "HAS_P": top_p}
                variants.append((split._race_kernel, {**chunk, **row, **race},
                                 {"CHUNK": split.CHUNK, "WITH_MAX": top_p, **flags}))
                variants.append((split._race_select_kernel, {**chunk, **row, **race, "out_ptr": "*i64"},
                                 {"CBLOCK": 128, **flags}))
        if top_p:
            variants.append((split._race_finish_kernel, {**chunk, **row, "out_ptr": "*i64"},
                             {"BLOCK": split.FINISH_BLOCK, "HAS_K": top_k}))
    for fn, sig, constexprs in variants:
        sig = {**sig, **{k: "constexpr" for k in constexprs}}
        sig = {name: sig[name] for name in fn.arg_names}  # in the kernel's argument order
        src = ASTSource(fn=fn, signature=sig, constexprs=constexprs)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4,
                                                                                 "enable_fp_fusion": False})
        ptx = compiled.asm["ptx"]
        assert compiled.asm["cubin"] and "fma.rn.f32" not in ptx and "ld.local" not in ptx, (fn, constexprs)


@pytest.mark.interpreter("sampling")
def test_triton_sampling_under_interpreter():
    """The Triton kernel against reference.sample on tiny CPU shapes, in a child process."""
    pytest.importorskip("triton")
    interpreter.check("sampling", timeout=840)
