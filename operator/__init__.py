"""pagefleet.operator."""
