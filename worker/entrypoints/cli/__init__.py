"""pagefleet.worker.entrypoints.cli: `pagefleet generate` and `pagefleet bench throughput | serve`."""
