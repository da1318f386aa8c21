"""Hypothesis settings of the malformed-input tests: deterministic (CI sees the same examples each
run), no deadline (a shared CPU is slow at times), no example database in the checkout."""

from __future__ import annotations

from hypothesis import HealthCheck, settings


def fuzz(examples: int) -> settings:
    return settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                    suppress_health_check=list(HealthCheck))
