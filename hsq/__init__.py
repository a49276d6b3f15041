"""hsq: hidden-state queue. Extract an LLM's hidden states at scale for EAGLE-3 drafters."""

__version__ = "0.1.0"
