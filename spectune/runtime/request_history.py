"""Per-request acceptance from what a runtime really knows: each request's own history.

When the drafter gives no informative confidences, the verify budget is ranked by an estimate of
each request's conditional acceptance a_r[i], built from

  rates[i]   the live population estimate of the conditional rate at draft position i + 1
             (``Planner.rates``: the online controller's estimate, the table's prior before it)
  acc[r]     drafts request r had accepted so far
  exp[r]     drafts it was expected to accept on the positions it was tested on:
             sum over its tested drafts of rates[position]

as a per-request drift shrunk toward the population with ``m`` pseudo-expected accepts:

  rho_r  = (acc[r] + m) / (exp[r] + m)          (1 for a new request)
  a_r[i] = clip(rates[i] * rho_r, 0, 1)          [b, K]

A request that keeps rejecting (rho_r < 1) loses budget to the ones that keep accepting. It is
never the replay's sampled truth: only accepted/tested counts a runtime already has.

The functions take numpy arrays or torch tensors alike (elementwise ops only), so the simulator
and the engine's device-side update use the same arithmetic.
"""

from __future__ import annotations

from typing import Any, TypeVar

REQUEST_SHRINK = 4.0  # pseudo-expected accepts pulling a request's drift toward the population

A = TypeVar("A")  # numpy.ndarray or torch.Tensor


def request_confidences(rates: Any, acc: Any, exp: Any, m: float = REQUEST_SHRINK) -> Any:
    """Conditional acceptance per (request, position) [b, K] from rates [K], acc [b], exp [b]."""
    rho = (acc + m) / (exp + m)  # [b]
    return (rates[None, :] * rho[:, None]).clip(0.0, 1.0)


def expected_accepts(rates_cum: Any, granted: Any, accepted: Any) -> Any:
    """Expected accepts [b] over the drafts each request had tested this step.

    ``rates_cum`` [K + 1]: 0 then the running sum of rates (rates_cum[j] = rates[0] + ... +
    rates[j - 1]); ``granted`` [b] drafts verified, ``accepted`` [b] the accepted prefix. The
    tested drafts are positions 0..min(accepted, granted - 1): every granted draft up to and
    including the first rejected one."""
    tested = accepted + (accepted < granted)  # accepted <= granted; + the rejected one if any
    return rates_cum[tested]
