"""spectune.kernels."""
