"""pagefleet.worker.engine: LLMEngine's step loop (schedule, run, postprocess), the async engine around it,
and the offline LLM API."""
