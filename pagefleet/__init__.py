"""pagefleet: an LLM inference platform for Kubernetes."""

__version__ = "0.1.0"
