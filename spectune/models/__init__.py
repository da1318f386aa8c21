"""spectune.models."""
