"""pagefleet.kernels."""
