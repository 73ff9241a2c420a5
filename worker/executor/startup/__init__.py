"""pagefleet.worker.executor.startup: kernel warm-up, parallel compile workers, the frozen start-up heap."""
