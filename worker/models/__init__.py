"""pagefleet.worker.models: the architectures we serve (registry), their layers, and the checkpoint loader."""
