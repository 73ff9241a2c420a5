"""KV-cache write (reshape-and-cache): scatter this step's keys and values into their slots."""
import triton
import triton.language as tl

from .fp8 import to_e4m3_range
from .reference import FP8_MAX

# e4m3's largest finite value as a constant the kernels may read: an fp8 cache saturates there
E4M3_MAX = tl.constexpr(FP8_MAX)


@triton.jit
def cache_value(x, cache_ptr):
    """x in the cache's element type. An e4m3 cache (--kv-cache-dtype fp8) stores x / 1.0, saturated (a plain cast
    past e4m3's range gives NaN): vLLM's default scale where the checkpoint brings none, so its fp8 cache and ours
    hold the same values."""
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        x = to_e4m3_range(x.to(tl.float32), 1.0, E4M3_MAX)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kcb, stride_kco, stride_kch, stride_vcb, stride_vco, stride_vch,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     BLOCK_HD: tl.constexpr):
    """Program (token, tile of heads x head_dim): one slot's rows; slot -1 (padding) writes nothing."""
    token, tile = tl.program_id(0), tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    block_id = slot // BLOCK_SIZE
    in_block = slot % BLOCK_SIZE
    offs = tile * BLOCK_HD + tl.arange(0, BLOCK_HD)  # over heads * head_dim
    mask = offs < NUM_KV_HEADS * HEAD_DIM
    head, d = offs // HEAD_DIM, offs % HEAD_DIM
    k = tl.load(k_ptr + token * stride_kt + head * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + head * stride_vh + d, mask=mask)
    tl.store(k_cache_ptr + block_id * stride_kcb + in_block * stride_kco + head * stride_kch + d,
             cache_value(k, k_cache_ptr), mask=mask)
    tl.store(v_cache_ptr + block_id * stride_vcb + in_block * stride_vco + head * stride_vch + d,
             cache_value(v, v_cache_ptr), mask=mask)


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping):
    """k, v [T, Hkv, D] (views of a fused qkv are fine) -> k_cache / v_cache [blocks, block_size, Hkv, D], in place."""
    T, Hkv, D = k.shape
    if T == 0:
        return
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    block_hd = min(triton.next_power_of_2(Hkv * D), 2048)
    grid = (T, triton.cdiv(Hkv * D, block_hd))
    _write_kv_kernel[grid](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=Hkv, HEAD_DIM=D, BLOCK_SIZE=k_cache.shape[1], BLOCK_HD=block_hd, num_warps=4)
