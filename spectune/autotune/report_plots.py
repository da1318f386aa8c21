"""PNG plots of ``spectune report``. Each ``*_png`` returns PNG bytes, or None when its input has
nothing to draw. matplotlib is imported inside the functions (Agg canvas, no pyplot state)."""

from __future__ import annotations

import io
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from spectune.runtime.costs import CostModel
from spectune.runtime.table import Point, Table

if TYPE_CHECKING:
    from spectune.autotune.report_inputs import Inputs, ResultSet

MAX_CDF_PANELS = 4
DEFAULT_BATCHES = (1, 4, 16, 64, 256)
MAX_LEGEND_BATCHES = 6  # more batch sizes than this: a colour bar, not a legend entry per batch


def _figure(ncols: int, width: float = 5.2, height: float = 3.8) -> tuple[Any, list[Any]]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * ncols, height), dpi=100, layout="constrained")
    return fig, list(fig.subplots(1, ncols, squeeze=False)[0])


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    return buf.getvalue()


def _colors(names: Sequence[str]) -> dict[str, Any]:
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
    return {n: cmap(i % 10) for i, n in enumerate(names)}


def _log2_x(ax: Any, ticks: Sequence[int]) -> None:
    ax.set_xscale("log", base=2)
    ticks = sorted(set(ticks))
    if ticks:
        ax.set_xticks(ticks, labels=[str(t) for t in ticks])
        ax.minorticks_off()


def _series(rs: ResultSet, arm: str, name: str) -> tuple[list[int], list[float]]:
    pts = [(r.concurrency, getattr(r, name)) for r in rs.rows if r.arm == arm and getattr(r, name) is not None]
    pts.sort()
    return [c for c, _ in pts], [float(v) for _, v in pts]


# ---------------------------------------------------------------------------------------------
# results


def goodput_png(rs: ResultSet) -> bytes:
    fig, (ax,) = _figure(1, width=6.5)
    colors = _colors(rs.arms)
    field = "decode_tok_s" if rs.rows and all(r.decode_tok_s is not None for r in rs.rows) else "output_tok_s"
    for arm in rs.arms:
        xs, ys = _series(rs, arm, field)
        ax.plot(xs, ys, marker="o", color=colors[arm], label=arm)
        px, py = _series(rs, arm, "predicted_tok_s")
        if px:
            ax.plot(px, py, linestyle=":", marker="x", color=colors[arm], label=f"{arm} (simulated)")
    _log2_x(ax, rs.concurrencies)
    ax.set(xlabel="concurrency", ylabel=field.replace("_tok_s", " tok/s"), title=rs.name)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return _png(fig)


def _per_arm_panels(rs: ResultSet, panels: Sequence[tuple[str, str]]) -> bytes | None:
    # panels: (field, y label); a panel is drawn only when some row has its field
    shown = [(f, label) for f, label in panels if any(getattr(r, f) is not None for r in rs.rows)]
    if not shown:
        return None
    fig, axes = _figure(len(shown))
    colors = _colors(rs.arms)
    for ax, (f, label) in zip(axes, shown, strict=True):
        for arm in rs.arms:
            xs, ys = _series(rs, arm, f)
            if xs:
                ax.plot(xs, ys, marker="o", color=colors[arm], label=arm)
        _log2_x(ax, rs.concurrencies)
        ax.set(xlabel="concurrency", ylabel=label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    return _png(fig)


def power_png(rs: ResultSet) -> bytes | None:
    return _per_arm_panels(rs, (("power_w", "board power (W)"), ("joules_per_token", "J / output token")))


def latency_png(rs: ResultSet) -> bytes | None:
    has_itl = any(r.itl_p50_ms is not None or r.itl_p99_ms is not None for r in rs.rows)
    has_ttft = any(r.ttft_ms is not None for r in rs.rows)
    if not (has_itl or has_ttft):
        return None
    fig, axes = _figure(int(has_itl) + int(has_ttft))
    colors = _colors(rs.arms)
    if has_itl:
        ax = axes[0]
        for arm in rs.arms:
            for f, style in (("itl_p50_ms", "-"), ("itl_p99_ms", "--")):
                xs, ys = _series(rs, arm, f)
                if xs:
                    ax.plot(xs, ys, linestyle=style, marker="o", color=colors[arm], label=f"{arm} {f[4:7]}")
        _log2_x(ax, rs.concurrencies)
        ax.set(xlabel="concurrency", ylabel="inter-token latency (ms)", title="ITL p50 (solid), p99 (dashed)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="x-small", ncol=2)
    if has_ttft:
        ax = axes[-1]
        for arm in rs.arms:
            xs, ys = _series(rs, arm, "ttft_ms")
            if xs:
                ax.plot(xs, ys, marker="o", color=colors[arm], label=arm)
        _log2_x(ax, rs.concurrencies)
        ax.set(xlabel="concurrency", ylabel="time to first token (ms)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    return _png(fig)


def itl_cdf_png(rs: ResultSet) -> bytes | None:
    concs = sorted({r.concurrency for r in rs.rows if r.itl_ms})
    if not concs:
        return None
    if len(concs) > MAX_CDF_PANELS:  # evenly spaced, first and last kept
        step = (len(concs) - 1) / (MAX_CDF_PANELS - 1)
        concs = [concs[round(i * step)] for i in range(MAX_CDF_PANELS)]
    fig, axes = _figure(len(concs), width=4.2)
    colors = _colors(rs.arms)
    for ax, c in zip(axes, concs, strict=True):
        for arm in rs.arms:
            r = rs.get(c, arm)
            if r is None or not r.itl_ms:
                continue
            xs = sorted(r.itl_ms)
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            ax.step(xs, ys, where="post", color=colors[arm], label=f"{arm} (n={len(xs)})")
        ax.set(xlabel="inter-token latency (ms)", ylabel="CDF", title=f"concurrency {c}", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    return _png(fig)


def k_png(inputs: Inputs) -> bytes | None:
    """Policy rows as a step plot of K vs batch; mean K (range min..max) from auto arms' k_hist."""
    policies = [t for t in inputs.tables if t.table.policy is not None]
    bench = [(rs, r) for rs in inputs.results for r in rs.rows if r.arm.startswith("auto") and r.k_counts]
    if not policies and not bench:
        return None
    fig, (ax,) = _figure(1, width=6.5)
    ticks: list[int] = []
    for t in policies:
        rows = t.table.policy.rows  # type: ignore[union-attr]
        xs = [r.batch[0] for r in rows] + [rows[-1].batch[1] + 1]
        ys = [r.k for r in rows] + [rows[-1].k]
        ax.step(xs, ys, where="post", label=f"policy {t.name.removeprefix('Table: ')}")
        ticks += [1, rows[-1].batch[1]]
    groups: dict[tuple[str, str], list[tuple[int, float, int, int]]] = {}
    for rs, r in bench:
        counts = r.k_counts
        mean = sum(k * n for k, n in counts.items()) / sum(counts.values())
        groups.setdefault((rs.slug, r.arm), []).append((r.concurrency, mean, min(counts), max(counts)))
        ticks.append(r.concurrency)
    for (slug, arm), pts in groups.items():
        pts.sort()
        xs = [p[0] for p in pts]
        ys = [p[1] for p in pts]
        err = [[p[1] - p[2] for p in pts], [p[3] - p[1] for p in pts]]
        ax.errorbar(xs, ys, yerr=err, fmt="o", capsize=3, label=f"{slug} {arm}: mean K (min..max)")
    _log2_x(ax, ticks)
    ax.set(xlabel="batch size (concurrency)", ylabel="K (draft tokens per request)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return _png(fig)


# ---------------------------------------------------------------------------------------------
# cost surfaces


def _model(tab: Table) -> CostModel:
    return CostModel.of(tab, residuals=False)  # the fit itself: its errors against the points


def predicted_ms(model: CostModel, p: Point) -> float:
    if p.kind in ("target", "tier"):
        return model.target_ms(p.tokens, p.batch)
    if p.kind == "drafter":
        return model.drafter_ms(p.batch, p.k or 0)
    return model.overhead_ms(p.tokens)


def point_errors(tab: Table) -> list[tuple[str, int, float, float]]:
    """Per point kind: (kind, points, median |model / measured - 1|, max of it)."""
    model = _model(tab)
    out = []
    for kind in ("target", "tier", "drafter", "overhead"):
        errs = [abs(predicted_ms(model, p) / p.ms - 1) for p in tab.costs.points
                if p.kind == kind and p.ms is not None and p.ms > 0]
        if errs:
            out.append((kind, len(errs), statistics.median(errs), max(errs)))
    return out


def _measured(tab: Table, kind: str) -> list[Point]:
    return [p for p in tab.costs.points if p.kind == kind and p.ms is not None]


def _batches(points: list[Point], max_batch: int) -> list[int]:
    found = sorted({p.batch for p in points})
    return found or [b for b in DEFAULT_BATCHES if b <= max_batch] or [1]


def _crowded_x(ax: Any) -> None:
    if len(ax.get_xticks()) > 6:  # a dozen tiers' labels would run together
        ax.tick_params(axis="x", labelrotation=45)


def _batch_colors(batches: Sequence[int]) -> tuple[Any, Any]:
    """(batch -> colour, colour bar mappable or None). Few batches: tab10 and a legend; many (a
    profile measures dozens): viridis on log2(batch) and one colour bar, as a legend entry per
    batch outgrows the panel (constrained layout then squashes the axes to a strip)."""
    from matplotlib import cm, colormaps
    from matplotlib.colors import LogNorm

    if len(batches) <= MAX_LEGEND_BATCHES:
        colors = _colors([str(b) for b in batches])
        return (lambda b: colors[str(b)]), None
    norm = LogNorm(vmin=min(batches), vmax=max(max(batches), min(batches) + 1))
    cmap = colormaps["viridis"]
    return (lambda b: cmap(norm(b))), cm.ScalarMappable(norm=norm, cmap=cmap)


def cost_png(tab: Table) -> bytes:
    """Target ms vs tokens per request and drafter ms vs K (one colour per batch: measured points,
    fitted model lines; a colour bar where there are many batches); tier replays and runtime
    overhead when measured."""
    model, w = _model(tab), tab.workload
    tiers, over = _measured(tab, "tier"), _measured(tab, "overhead")
    fig, axes = _figure(2 + bool(tiers) + bool(over), width=4.6)
    target = _measured(tab, "target")
    drafter = _measured(tab, "drafter")
    qmax = max([w.max_k + 1] + [p.q or p.tokens // p.batch for p in target])
    kmax = max([w.max_k] + [p.k or 0 for p in drafter] + [1])
    batches, dbatches = _batches(target, w.max_batch), _batches(drafter, w.max_batch)
    color, bar = _batch_colors(sorted({*batches, *dbatches}))  # one scale: a batch has one colour
    ax = axes[0]
    for b in batches:
        qs = list(range(1, qmax + 1))
        ax.plot(qs, [model.target_ms(b * q, b) for q in qs], color=color(b), label=f"batch {b}")
        pts = [p for p in target if p.batch == b]
        ax.plot([p.q or p.tokens // p.batch for p in pts], [p.ms for p in pts], "o", color=color(b))
    ax.set(xlabel="tokens per request (q = K + 1)", ylabel="target step (ms)", title="target: points vs model")
    ax = axes[1]
    for b in dbatches:
        ks = list(range(0, kmax + 1))
        ax.plot(ks, [model.drafter_ms(b, k) for k in ks], color=color(b), label=f"batch {b}")
        pts = [p for p in drafter if p.batch == b]
        ax.plot([p.k or 0 for p in pts], [p.ms for p in pts], "o", color=color(b))
    ax.set(xlabel="K (draft tokens)", ylabel="drafter (ms)", title=f"drafter ({w.drafter_kind})")
    if bar is not None:
        cb = fig.colorbar(bar, ax=axes[:2], pad=0.01, fraction=0.04)
        lo, hi = bar.norm.vmin, int(bar.norm.vmax)
        ticks = [1 << i for i in range(hi.bit_length()) if lo <= 1 << i <= hi]
        cb.set_ticks(ticks, labels=[str(t) for t in ticks])
        cb.minorticks_off()
        cb.set_label("batch size")
    i = 2
    if tiers:
        ax = axes[i]
        ax.plot([p.tokens for p in tiers], [p.ms for p in tiers], "o", label="measured")
        ax.plot([p.tokens for p in tiers], [predicted_ms(model, p) for p in tiers], "x", label="model")
        _log2_x(ax, [p.tokens for p in tiers])
        _crowded_x(ax)
        ax.set(xlabel="tier tokens (padded step)", ylabel="target step (ms)", title="tier replays")
        i += 1
    if over:
        ax = axes[i]
        toks = sorted({p.tokens for p in over})
        ax.plot(toks, [model.overhead_ms(n) for n in toks], label="model")
        ax.plot([p.tokens for p in over], [p.ms for p in over], "o", label="measured")
        _log2_x(ax, toks)
        _crowded_x(ax)
        ax.set(xlabel="step tokens", ylabel="overhead (ms)", title="runtime overhead")
    for n, ax in enumerate(axes):
        ax.grid(alpha=0.3)
        if n >= 2 or bar is None:  # with a colour bar the batch panels need no legend
            ax.legend(fontsize="small")
    fig.suptitle(f"{tab.hardware.gpu}: {w.target} / {w.drafter}, context {w.context_len} (points measured, lines fitted)")
    return _png(fig)
