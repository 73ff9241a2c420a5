"""pagefleet.worker.entrypoints: the only part of the worker that knows HTTP: the OpenAI server, its process, and
the CLI commands."""
