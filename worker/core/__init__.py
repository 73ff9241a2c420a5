"""pagefleet.worker.core: the engine's torch-free core: sequences, sampling params, the KV block manager, the
scheduler, outputs, detokenisation."""
