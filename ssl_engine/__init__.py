"""ssl_engine: a phase/epoch training engine for self-supervised and supervised vision models."""

__version__ = "0.1.0"
