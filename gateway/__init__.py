"""pagefleet.gateway."""
