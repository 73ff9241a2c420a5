"""pagefleet.worker.executor.startup: start-up work: kernel warm-up, parallel compile workers, the frozen start-up heap."""
