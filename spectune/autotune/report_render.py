"""Report blocks and their two renderings: Markdown (PNGs beside it) and one self-contained HTML
page (PNGs embedded as base64 data URIs, inline CSS, no external source of any kind)."""

from __future__ import annotations

import base64
import html
from dataclasses import dataclass

Cell = tuple[str, bool]  # (text, bold)


@dataclass(frozen=True)
class Heading:
    text: str
    level: int  # 1..3


@dataclass(frozen=True)
class Para:
    text: str


@dataclass(frozen=True)
class WarningBlock:
    text: str


@dataclass(frozen=True)
class Bullets:
    items: tuple[tuple[str, str], ...]  # (key, value)


@dataclass(frozen=True)
class TableBlock:
    head: tuple[str, ...]
    rows: tuple[tuple[Cell, ...], ...]  # each [len(head)]
    caption: str


@dataclass(frozen=True)
class Figure:
    file: str  # PNG file name beside report.md
    title: str


Block = Heading | Para | WarningBlock | Bullets | TableBlock | Figure


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _md_table(t: TableBlock) -> list[str]:
    numeric = [all(_looks_numeric(r[i][0]) for r in t.rows) for i in range(len(t.head))]
    lines = ["| " + " | ".join(_md_cell(h) for h in t.head) + " |",
             "|" + "|".join("---:" if n else "---" for n in numeric) + "|"]
    for row in t.rows:
        lines.append("| " + " | ".join(f"**{_md_cell(x)}**" if bold else _md_cell(x) for x, bold in row) + " |")
    return lines


def _looks_numeric(text: str) -> bool:
    s = text.strip().rstrip("x%").lstrip("+-")
    return s == "–" or s.replace(".", "", 1).isdigit()


def render_markdown(blocks: list[Block]) -> str:
    out: list[str] = []
    for b in blocks:
        if isinstance(b, Heading):
            out += ["#" * b.level + " " + b.text, ""]
        elif isinstance(b, Para):
            out += [b.text, ""]
        elif isinstance(b, WarningBlock):
            out += [f"> **WARNING**: {b.text}", ""]
        elif isinstance(b, Bullets):
            out += [f"- **{k}**: {v}" for k, v in b.items] + [""]
        elif isinstance(b, TableBlock):
            out += _md_table(b) + [""]
            if b.caption:
                out += [f"*{b.caption}*", ""]
        elif isinstance(b, Figure):
            out += [f"![{b.title}]({b.file})", ""]
    return "\n".join(out).rstrip() + "\n"


_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1em; }
th, td { border: 1px solid #ccc; padding: 3px 8px; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
caption { caption-side: bottom; font-size: 0.85em; color: #666; }
.warn { background: #fff3cd; border-left: 4px solid #d9534f; padding: 4px 10px; font-weight: 600; }
img { max-width: 100%; }
"""


def _html_table(t: TableBlock) -> list[str]:
    esc = html.escape
    numeric = [all(_looks_numeric(r[i][0]) for r in t.rows) for i in range(len(t.head))]
    out = ["<table>"]
    if t.caption:
        out.append(f"<caption>{esc(t.caption)}</caption>")
    out.append("<tr>" + "".join(f"<th>{esc(h)}</th>" for h in t.head) + "</tr>")
    for row in t.rows:
        tds = []
        for i, (text, bold) in enumerate(row):
            inner = f"<b>{esc(text)}</b>" if bold else esc(text)
            tds.append(f'<td class="num">{inner}</td>' if numeric[i] else f"<td>{inner}</td>")
        out.append("<tr>" + "".join(tds) + "</tr>")
    out.append("</table>")
    return out


def render_html(blocks: list[Block], images: dict[str, bytes], title: str) -> str:
    esc = html.escape
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">', f"<title>{esc(title)}</title>",
           f"<style>{_CSS}</style>", "</head><body>"]
    for b in blocks:
        if isinstance(b, Heading):
            out.append(f"<h{b.level}>{esc(b.text)}</h{b.level}>")
        elif isinstance(b, Para):
            out.append(f"<p>{esc(b.text)}</p>")
        elif isinstance(b, WarningBlock):
            out.append(f'<p class="warn">WARNING: {esc(b.text)}</p>')
        elif isinstance(b, Bullets):
            out.append("<ul>" + "".join(f"<li><b>{esc(k)}</b>: {esc(v)}</li>" for k, v in b.items) + "</ul>")
        elif isinstance(b, TableBlock):
            out += _html_table(b)
        elif isinstance(b, Figure):
            data = base64.b64encode(images[b.file]).decode("ascii")
            out.append(f'<figure><img alt="{esc(b.title)}" src="data:image/png;base64,{data}">'
                       f"<figcaption>{esc(b.title)}</figcaption></figure>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"
