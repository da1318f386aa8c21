"""Property-based: every acceptance parser (curve:, mixture:, public:, a vLLM Prometheus scrape,
per-step JSONL traces, plain or gzip) returns a valid AcceptanceModel or raises AcceptanceError
naming the source; never another exception, never a model a table would refuse.

Examples: 1,200 inline specs + 1,500 metrics scrapes + 1,500 trace files (docs/RELIABILITY.md).
"""

from __future__ import annotations

import gzip
import json
import math
import tempfile
import warnings
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from spectune.autotune.acceptance import AcceptanceError, AcceptanceModel, load_acceptance
from spectune.autotune.acceptance_sources import (
    METRIC_ACCEPTED,
    METRIC_DRAFT_TOKENS,
    METRIC_DRAFTS,
    METRIC_PER_POS,
)
from spectune.runtime.table import check_acceptance_section
from tests.fuzz import fuzz

WORK = Path(tempfile.mkdtemp(prefix="spectune-acc-fuzz-"))
MAX_K = 5


def loads_or_refuses(spec: str) -> AcceptanceModel | None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            model = load_acceptance(spec, max_k=MAX_K)
        except AcceptanceError as exc:
            assert "\n" not in str(exc)
            return None
    # what tune would write: the table's schema accepts it
    check_acceptance_section(model.to_dict())
    assert model.max_k == MAX_K and all(math.isfinite(x) for c in model.components for x in c.accept)
    return model


number = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 5),
                   st.sampled_from([0.0, 1.0, 0.5, 1e-9, 1.0000001, -0.0]))
num_text = st.one_of(number.map(str), st.text(alphabet="0123456789.eE+-naif ", max_size=8))


@st.composite
def inline_spec(draw):
    kind = draw(st.sampled_from(["curve", "mixture", "public", "raw"]))
    if kind == "curve":
        return "curve:" + ",".join(draw(st.lists(num_text, max_size=8)))
    if kind == "mixture":
        terms = draw(st.lists(st.tuples(num_text, st.lists(num_text, max_size=5)), max_size=4))
        sep = draw(st.sampled_from(["+", " + ", "++", ""]))
        return "mixture:" + sep.join(f"{w}*curve({','.join(c)})" for w, c in terms)
    if kind == "public":
        return "public:" + "/".join(draw(st.lists(st.sampled_from(
            ["EAGLE-3", "Llama-3.1-8B-Instruct", "MT-Bench", "x", "", "..", "EAGLE"]), max_size=4)))
    return draw(st.text(max_size=30).filter(lambda t: not t.lower().strip().startswith(("http", "metrics:"))))


@fuzz(1200)
@given(spec=inline_spec())
def test_inline_sources(spec):
    loads_or_refuses(spec)


# -- vLLM Prometheus exposition --------------------------------------------------------------------

value = st.one_of(st.sampled_from(["NaN", "+Inf", "-Inf", "-3", "0", "1e308", "1e400", "abc", ""]),
                  st.floats(-10, 1e6, allow_nan=False).map(repr), st.integers(0, 10**6).map(str))
label_value = st.one_of(st.integers(-2, 8).map(str), st.sampled_from(["x", "", "1.5", "99999"]))


@st.composite
def scrape(draw):
    lines = []
    if draw(st.booleans()):
        lines.append(f"# TYPE {METRIC_DRAFTS} counter")
    model = draw(st.sampled_from(['model_name="m"', 'model_name="m",engine="0"', 'model_name="n"', ""]))
    for name in draw(st.lists(st.sampled_from([METRIC_DRAFTS, METRIC_DRAFT_TOKENS, METRIC_ACCEPTED]),
                              max_size=4)):
        lines.append(f"{name}_total{{{model}}} {draw(value)}")
    for _ in range(draw(st.integers(0, 6))):
        lines.append(f'{METRIC_PER_POS}_total{{{model},position="{draw(label_value)}"}} {draw(value)}')
    lines += draw(st.lists(st.text(max_size=30), max_size=2))
    return "\n".join(draw(st.permutations(lines))) + draw(st.sampled_from(["\n", "", "\n\n"]))


def consistent_scrape(n: int, per_pos: list[int]) -> str:
    accepted = sum(per_pos)
    return "\n".join([f'{METRIC_DRAFTS}_total{{model_name="m"}} {n}',
                      f'{METRIC_DRAFT_TOKENS}_total{{model_name="m"}} {n * len(per_pos)}',
                      f'{METRIC_ACCEPTED}_total{{model_name="m"}} {accepted}',
                      *(f'{METRIC_PER_POS}_total{{model_name="m",position="{i}"}} {c}'
                        for i, c in enumerate(per_pos))]) + "\n"


@fuzz(1500)
@given(text=scrape())
def test_metrics_scrapes(text):
    path = WORK / "scrape.prom"
    path.write_text(text)
    loads_or_refuses(f"metrics:{path}")


def test_a_consistent_scrape_loads_and_bad_counters_are_refused():
    path = WORK / "ok.prom"
    path.write_text(consistent_scrape(100, [80, 60, 45]))
    model = loads_or_refuses(f"metrics:{path}")
    assert model is not None and abs(model.mean_survival(3)[0] - 0.8) < 1e-9
    for bad, needle in ((consistent_scrape(100, [80, 90, 45]), "position=\"1\""),
                        (consistent_scrape(100, [180, 60, 45]), METRIC_DRAFTS),
                        (consistent_scrape(100, [80, 60]).replace(" 140\n", " NaN\n"), "is nan"),
                        (consistent_scrape(100, [80, 60]).replace(" 100\n", " -100\n", 1), "-100")):
        path.write_text(bad)
        try:
            load_acceptance(f"metrics:{path}", max_k=MAX_K)
        except AcceptanceError as exc:
            assert needle in str(exc) and str(path) in str(exc)
        else:
            raise AssertionError(f"accepted: {bad}")


# -- per-step traces ---------------------------------------------------------------------------------

field_value = st.one_of(st.integers(-3, 8), st.none(), st.booleans(), st.text(max_size=4), number,
                        st.lists(number, max_size=6))


@st.composite
def trace_lines(draw):
    lines = []
    for _ in range(draw(st.integers(0, 8))):
        if draw(st.integers(0, 9)) == 0:
            lines.append(draw(st.text(max_size=20)))
            continue
        rec = {}
        for key in ("request", "step", "offered", "accepted", "conf"):
            if draw(st.integers(0, 5)) > 0:
                rec[key] = draw(field_value)
        if draw(st.booleans()) and isinstance(rec.get("offered"), int) and not isinstance(rec["offered"], bool):
            rec["conf"] = [draw(st.floats(0, 1)) for _ in range(max(0, min(rec["offered"], 8)))]
        lines.append(json.dumps(rec))
    return lines


@fuzz(1500)
@given(lines=trace_lines(), gz=st.booleans(), corrupt=st.integers(0, 6))
def test_trace_files(lines, gz, corrupt):
    data = ("\n".join(lines) + "\n").encode()
    path = WORK / ("t.jsonl.gz" if gz else "t.jsonl")
    blob = gzip.compress(data) if gz else data
    if corrupt == 0:  # a torn or damaged file
        blob = blob[: len(blob) // 2] + b"\xff\xfe" + blob[len(blob) // 2:]
    path.write_bytes(blob)
    loads_or_refuses(str(path))


def test_deep_and_endless_trace_lines_are_refused():
    deep = WORK / "deep.jsonl"
    deep.write_text('{"a":' * 100_000 + "1" + "}" * 100_000 + "\n")
    assert loads_or_refuses(str(deep)) is None
    long = WORK / "long.jsonl"
    long.write_text("0" * (2**20 + 10))  # one line with no end, like /dev/zero
    assert loads_or_refuses(str(long)) is None
