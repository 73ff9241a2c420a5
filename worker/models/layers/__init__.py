"""pagefleet.worker.models.layers: the layers models are built from, over one kernel switch.

ops (the kernel switch: Triton or the torch references), context (what each forward reads), paged_attention,
linear, fp8 (e4m3 linears and the pass that makes them), norm (RMSNorm), lora (adapter slots).
"""
