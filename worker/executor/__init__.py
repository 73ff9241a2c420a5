"""pagefleet.worker.executor: one step on the device: step inputs, the forward (CUDA graph or eager), sampling, the
KV cache and its sizing, bring-up."""
