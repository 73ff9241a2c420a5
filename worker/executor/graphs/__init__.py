"""pagefleet.worker.executor.graphs: CUDA graphs of decode, prompt and mixed steps, and the manager that picks one."""
