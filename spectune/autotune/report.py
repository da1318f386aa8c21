"""``spectune report``: Markdown and self-contained HTML reports with PNG plots.

The report holds the A/B table engines' PRs use (rows = concurrency, columns = arms, cells =
output tok/s, best in bold, auto / best-other and auto / plain), exactness per arm,
simulator-vs-measured goodput, chosen K, cost surfaces, power, J/token and latency plots, and a
visible warning for throttled, failed or inexact runs. Inputs: :mod:`.report_inputs`; blocks and
their Markdown/HTML rendering: :mod:`.report_render`; PNGs: :mod:`.report_plots`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from spectune.autotune.report_inputs import (
    BenchRow,
    Inputs,
    ReportError,
    ResultSet,
    TableInput,
    arm_order,
    load_inputs,
    read_results,
)
from spectune.autotune.report_render import (
    Block,
    Bullets,
    Figure,
    Heading,
    Para,
    TableBlock,
    WarningBlock,
    render_html,
    render_markdown,
)

__all__ = [
    "BenchRow", "Inputs", "Report", "ReportError", "ResultSet", "TableInput", "ab_table", "build_report",
    "exactness_table", "load_inputs", "make_report", "prediction_table", "rate_field", "read_results",
    "result_warnings",
    "table_warnings", "write_report",
]

IDLE_THROTTLE_BIT = 0x1  # nvmlClocksEventReasonGpuIdle
MISSING = "–"
MAX_TOP_WARNINGS = 12  # listed at the top; each section lists its own in full

# ---------------------------------------------------------------------------------------------
# tables and warnings


def auto_arm(arms: Sequence[str]) -> str | None:
    if "auto" in arms:
        return "auto"
    return next((a for a in arms if a.startswith("auto")), None)


RATE_CAPTION = {
    "output_tok_s": "output tok/s (end to end: prefill, admission and decode)",
    "decode_tok_s": "decode tok/s (tokens of decode/verify steps over their time; prefill left out)",
}


def rate_field(rs: ResultSet) -> str:
    """The throughput speculation changes: decode tok/s where every row has it, else output tok/s."""
    return "decode_tok_s" if rs.rows and all(r.decode_tok_s is not None for r in rs.rows) else "output_tok_s"


def ab_table(rs: ResultSet, field: str = "output_tok_s") -> TableBlock:
    """Rows = concurrency, columns = arms (tok/s, best of the row in bold), then auto ratios; a
    null (not measured) cell is a dash."""
    arms = rs.arms
    auto = auto_arm(arms)
    base = [a for a in arms if not a.startswith("auto")]
    head = ["concurrency", *arms]
    if auto and base:
        head.append(f"{auto} / best other")
    if auto and "plain" in arms:
        head.append(f"{auto} / plain")
    rows = []
    for c in rs.concurrencies:
        vals = {a: float(v) for a in arms if (r := rs.get(c, a)) is not None and (v := getattr(r, field)) is not None}
        top = max(vals.values(), default=None)
        cells = [(str(c), False)] + [(f"{vals[a]:.1f}", vals[a] == top) if a in vals else (MISSING, False)
                                     for a in arms]
        mine = vals.get(auto) if auto else None
        if auto and base:
            other = max((vals[a] for a in base if a in vals), default=None)
            cells.append((_ratio(mine, other), False))
        if auto and "plain" in arms:
            cells.append((_ratio(mine, vals.get("plain")), False))
        rows.append(cells)
    return TableBlock(tuple(head), tuple(tuple(r) for r in rows), f"cells: {RATE_CAPTION[field]}, best of each row in bold")


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.3f}x" if a is not None and b else MISSING


def exactness_table(rs: ResultSet) -> TableBlock | None:
    if all(r.completed is None and r.failed is None and r.mismatches is None for r in rs.rows):
        return None
    rows = []
    for arm in rs.arms:
        mine = [r for r in rs.rows if r.arm == arm]
        cells = [(arm, False)]
        for name in ("completed", "failed", "mismatches"):
            vals = [getattr(r, name) for r in mine if getattr(r, name) is not None]
            total = sum(vals) if vals else None
            cells.append((MISSING if total is None else str(total), name != "completed" and bool(total)))
        rows.append(tuple(cells))
    return TableBlock(("arm", "completed", "failed", "mismatches"), tuple(rows), "totals over concurrencies")


def prediction_table(rs: ResultSet) -> tuple[TableBlock, str] | None:
    rows = sorted((r for r in rs.rows if r.predicted_tok_s is not None),
                  key=lambda r: (r.concurrency, arm_order(r.arm)))
    if not rows:
        return None
    cells, errs = [], []
    field = rate_field(rs)
    for r in rows:
        pred = float(r.predicted_tok_s or 0.0)
        measured = getattr(r, field)
        err = (pred / measured - 1) * 100 if measured else None
        errs += [] if err is None else [abs(err)]
        cells.append(((str(r.concurrency), False), (r.arm, False), (MISSING if measured is None else f"{measured:.1f}", False),
                      (f"{pred:.1f}", False), (MISSING if err is None else f"{err:+.1f}%", False)))
    absv = sorted(errs)
    summary = (f"Simulator error over {len(errs)} points: median {absv[len(absv) // 2]:.1f}%, "
               f"max {absv[-1]:.1f}% (predicted / measured - 1)." if absv else "")
    return TableBlock(("concurrency", "arm", f"measured {field.removesuffix('_s').replace('_', ' ')}/s",
                       "predicted tok/s", "error"), tuple(cells),
                      f"simulator predicted vs measured {RATE_CAPTION[field]}"), summary


def k_share_table(rs: ResultSet) -> TableBlock | None:
    rows = []
    for r in sorted(rs.rows, key=lambda r: (arm_order(r.arm), r.concurrency)):
        counts = r.k_counts
        if not counts or not r.arm.startswith("auto"):
            continue
        total = sum(counts.values())
        mean = sum(k * n for k, n in counts.items()) / total
        share = ", ".join(f"K{k}: {100 * n / total:.0f}%" for k, n in sorted(counts.items(), key=lambda kv: -kv[1]))
        acc = MISSING if r.mean_accept_len is None else f"{r.mean_accept_len:.2f}"
        rows.append(((r.arm, False), (str(r.concurrency), False), (f"{mean:.2f}", False), (share, False), (acc, False)))
    if not rows:
        return None
    return TableBlock(("arm", "concurrency", "mean K", "steps by K", "accept len"), tuple(rows), "chosen K")


def result_warnings(rs: ResultSet) -> list[str]:
    out = []
    for r in rs.rows:
        where = f"{Path(rs.file).name}: concurrency {r.concurrency}, arm {r.arm}"
        if r.bad_throttle:
            out.append(f"{where}: GPU throttled ({', '.join(r.bad_throttle)})")
        if r.timed_out:
            run = f" (repeat {r.repeat})" if r.repeat is not None else ""
            out.append(f"{where}{run}: timed out at the time limit")
        if r.failed:
            out.append(f"{where}: {r.failed} failed requests")
        if r.mismatches:
            out.append(f"{where}: {r.mismatches} outputs differ from plain greedy decoding")
    return out


def table_warnings(t: TableInput) -> list[str]:
    hot = [p for p in t.table.costs.points if p.throttle and p.throttle & ~IDLE_THROTTLE_BIT]
    if not hot:
        return []
    return [f"{Path(t.file).name}: {len(hot)} of {len(t.table.costs.points)} cost points measured while the "
            f"GPU was throttled"]


# ---------------------------------------------------------------------------------------------
# report


@dataclass(frozen=True)
class Report:
    markdown: str
    html: str
    images: dict[str, bytes]  # file name -> PNG bytes
    warnings: tuple[str, ...] = field(default_factory=tuple)


def _result_blocks(rs: ResultSet, images: dict[str, bytes]) -> list[Block]:
    from spectune.autotune import report_plots as rp

    blocks: list[Block] = [Heading(rs.name, 2)]
    if rs.header:
        blocks.append(Bullets(tuple(rs.header.items())))
    warns = result_warnings(rs)
    blocks += [WarningBlock(w) for w in warns]
    field = rate_field(rs)
    if field != "output_tok_s":
        blocks += [Heading("A/B: decode tok/s", 3), ab_table(rs, field)]
    if any(r.output_tok_s is not None for r in rs.rows):  # null: not measured (simulate without a prompt)
        blocks += [Heading("A/B: output tok/s", 3), ab_table(rs)]
    plots = [("goodput", "Goodput vs concurrency", rp.goodput_png(rs)),
             ("power", "Power and energy per token", rp.power_png(rs)),
             ("latency", "Inter-token latency", rp.latency_png(rs)),
             ("itl_cdf", "Inter-token latency distribution", rp.itl_cdf_png(rs))]
    exact = exactness_table(rs)
    if exact is not None:
        blocks += [Heading("Exactness", 3), exact]
    pred = prediction_table(rs)
    if pred is not None:
        blocks += [Heading("Simulator vs measured", 3), pred[0]]
        if pred[1]:
            blocks.append(Para(pred[1]))
    ks = k_share_table(rs)
    if ks is not None:
        blocks += [Heading("Chosen K", 3), ks]
    for tag, title, png in plots:
        if png is not None:
            name = f"{rs.slug}_{tag}.png"
            images[name] = png
            blocks.append(Figure(name, title))
    return blocks


def _table_blocks(t: TableInput, images: dict[str, bytes]) -> list[Block]:
    from spectune.autotune import report_plots as rp

    tab = t.table
    w, hw, err = tab.workload, tab.hardware, tab.costs.error
    blocks: list[Block] = [Heading(t.name, 2), Bullets((
        ("gpu", hw.gpu), ("driver", hw.driver or MISSING),
        ("target / drafter", f"{w.target} / {w.drafter} ({w.drafter_kind}, drafter layers: {w.drafter_layers})"),
        ("dtype / context", f"{w.dtype} / {w.context_len}"), ("max K / max batch", f"{w.max_k} / {w.max_batch}"),
        ("cost model error", f"median {100 * err.median_rel:.1f}%, max {100 * err.max_rel:.1f}% "
                             f"on {err.held_out} held-out points ({tab.costs.timer})")))]
    blocks += [WarningBlock(x) for x in table_warnings(t)]
    fit = rp.point_errors(tab)
    if fit:
        blocks += [Heading("Cost model vs measured points", 3),
                   TableBlock(("kind", "points", "median |error|", "max |error|"),
                              tuple(((k, False), (str(n), False), (f"{100 * med:.1f}%", False),
                                     (f"{100 * mx:.1f}%", False)) for k, n, med, mx in fit), "")]
    if tab.costs.capture:
        blocks += [Heading("Graph capture per tier", 3),
                   TableBlock(("tier tokens", "seconds", "MiB"),
                              tuple(((str(c.tokens), False), (f"{c.seconds:.2f}", False), (f"{c.mib:.0f}", False))
                                    for c in tab.costs.capture), "")]
    if tab.policy is not None:
        blocks += [Heading("Policy rows", 3), TableBlock(
            ("batch", "K", "verify budget", "tier", "gain vs plain"),
            tuple(((f"{r.batch[0]}-{r.batch[1]}", False), (str(r.k), False), (str(r.verify_budget), False),
                   (MISSING if r.tier is None else str(r.tier), False),
                   (MISSING if r.gain is None else f"{r.gain:.3f}x", False)) for r in tab.policy.rows), ""),
            Para(f"tiers: {', '.join(map(str, tab.policy.tiers))}; online: window {tab.policy.online.window:g} drafts, "
                 f"margin {tab.policy.online.margin:g}; objective: {tab.policy.objective}")]
    png = rp.cost_png(tab)
    if png is not None:
        images[f"{t.slug}_costs.png"] = png
        blocks.append(Figure(f"{t.slug}_costs.png", "Measured costs vs fitted model"))
    return blocks


def build_report(inputs: Inputs, title: str = "spectune report") -> Report:
    """Assemble blocks for every input, draw the plots, render Markdown and HTML."""
    from spectune import __version__
    from spectune.autotune import report_plots as rp

    images: dict[str, bytes] = {}
    warns = [w for rs in inputs.results for w in result_warnings(rs)]
    warns += [w for t in inputs.tables for w in table_warnings(t)]
    files = dict.fromkeys(Path(f).name for f in [*(r.file for r in inputs.results), *(t.file for t in inputs.tables)])
    blocks: list[Block] = [Heading(title, 1), Para(f"spectune {__version__}; inputs: {', '.join(files)}")]
    blocks += [WarningBlock(w) for w in warns[:MAX_TOP_WARNINGS]]
    if len(warns) > MAX_TOP_WARNINGS:
        blocks.append(WarningBlock(f"... and {len(warns) - MAX_TOP_WARNINGS} more (see the sections below)"))
    for rs in inputs.results:
        blocks += _result_blocks(rs, images)
    k_png = rp.k_png(inputs)
    if k_png is not None:
        images["k_vs_batch.png"] = k_png
        blocks += [Heading("Chosen K vs batch size", 2), Figure("k_vs_batch.png", "Chosen K vs batch size")]
    for t in inputs.tables:
        blocks += _table_blocks(t, images)
    return Report(render_markdown(blocks), render_html(blocks, images, title), images, tuple(warns))


def write_report(report: Report, out: str | os.PathLike[str]) -> list[Path]:
    """Write report.md, report.html and the PNGs into ``out``: everything is built in a temporary
    folder beside it, then moved in (the folder itself when new, else file by file, Markdown last)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ReportError(out, "", "exists and is not a folder")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    except OSError as exc:  # read-only or missing parent: name the folder asked for
        raise ReportError(out, "", f"cannot write: {exc.strerror or exc}") from None
    tmp.chmod(0o755)  # mkdtemp makes it private; a report folder is for reading
    names = [*sorted(report.images), "report.html", "report.md"]
    try:
        for name, data in report.images.items():
            (tmp / name).write_bytes(data)
        (tmp / "report.html").write_text(report.html, encoding="utf-8")
        (tmp / "report.md").write_text(report.markdown, encoding="utf-8")
        try:
            os.rename(tmp, out)  # new (or empty) folder: appears whole
        except OSError:
            for name in names:
                os.replace(tmp / name, out / name)
    except OSError as exc:  # e.g. a full disk while writing: one line naming the folder
        raise ReportError(out, "", f"cannot write: {exc.strerror or exc}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return [out / n for n in names]


def make_report(paths: Sequence[str | os.PathLike[str]], out: str | os.PathLike[str]) -> tuple[Report, list[Path]]:
    """Read the inputs, build the report and write it to ``out``; nothing is written on bad input."""
    report = build_report(load_inputs(paths))
    return report, write_report(report, out)
