"""pagefleet.worker.models.layers: the layers models are built from, over the one kernel switch (ops)."""
