"""spectune.autotune."""
