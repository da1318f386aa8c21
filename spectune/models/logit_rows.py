"""Logits of chosen rows of a forward: a prefill forward needs only its pieces' last tokens.

A target callable ``(input_ids [T], positions [T], meta) -> logits [T, V]`` that also takes
``logit_rows`` [R] (the reference decoder, ``DecisiveLogits``) runs its lm_head over those rows
only; ``logits_at`` asks for them that way, and indexes the full logits of any other target.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from torch import Tensor

from spectune.kernels.attention_metadata import AttnMeta


@functools.lru_cache(maxsize=64)
def _takes_rows(kind: Any) -> bool:
    try:
        fn = kind.forward if hasattr(kind, "forward") else kind.__call__
        return "logit_rows" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def logits_at(target: Callable[[Tensor, Tensor, AttnMeta], Tensor], input_ids: Tensor, positions: Tensor,
              meta: AttnMeta, rows: Tensor) -> Tensor:
    """[R, V] logits of the forward's ``rows`` (device int64)."""
    kind: Any = type(target)
    if _takes_rows(kind):
        return target(input_ids, positions, meta, logit_rows=rows)  # type: ignore[call-arg]
    return target(input_ids, positions, meta).index_select(0, rows)
