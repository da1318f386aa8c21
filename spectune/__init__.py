"""spectune: measure, tune and run adaptive speculative decoding, one GPU at a time."""

__version__ = "0.1.0"
