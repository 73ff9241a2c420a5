"""pagefleet.worker.executor.graphs: CUDA graphs for decode, prompt and mixed steps over static input buffers."""
