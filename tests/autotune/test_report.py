import base64
import io
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
from PIL import Image

from spectune.autotune.report import (
    BenchRow,
    ResultSet,
    ab_table,
    build_report,
    exactness_table,
    load_inputs,
    prediction_table,
    rate_field,
    table_warnings,
    write_report,
)
from spectune.autotune.report_plots import point_errors, predicted_ms
from spectune.cli import main
from spectune.runtime.costs import CostModel
from spectune.runtime.table import (
    CapturePoint,
    CostError,
    Hardware,
    Point,
    Row,
    Software,
    Table,
    write_table,
)
from tests.tables import make_params, make_policy, make_profile, make_workload

DATA = Path(__file__).parent / "data"
BENCH = DATA / "bench_small.json"


def make_table(with_policy: bool = True, with_points: bool = True) -> Table:
    params = make_params(target=(4.9, 0.002, 48, 0.03, 0.9), drafter=(0.05, 0.38, 0.0004),
                         overhead=(0.04, 0.0002), power=(110, 650, 512))
    w = make_workload(7, 64)
    model = CostModel(params, w.drafter_kind, w.context_len)
    points = []
    if with_points:
        wobble = [1.03, 0.98, 1.01, 0.96, 1.02]  # measured = model * wobble: known relative errors
        for i, (b, q) in enumerate((b, q) for b in (1, 4, 16, 64) for q in (1, 2, 4, 8)):
            points.append(Point("target", b, b * q, model.target_ms(b * q, b) * wobble[i % 5], q=q,
                                power_w=300.0, throttle=1))
        for i, (b, k) in enumerate((b, k) for b in (1, 16) for k in (1, 3, 7)):
            points.append(Point("drafter", b, b * k, model.drafter_ms(b, k) * wobble[i % 5], k=k))
        for i, (b, n) in enumerate(((8, 64), (40, 128), (100, 256))):
            points.append(Point("tier", b, n, model.target_ms(n, b) * wobble[i % 5]))
        for i, n in enumerate((16, 64, 256)):
            points.append(Point("overhead", 8, n, model.overhead_ms(n) * wobble[i % 5]))
        points.append(Point("target", 128, 1024, None, q=8))  # infeasible point: drawn nowhere
    policy = None
    if with_policy:
        policy = make_policy([64, 128, 256], [
            Row((1, 4), 7, 20, tier=64, gain=2.01), Row((5, 16), 4, 48, tier=64, gain=1.61),
            Row((17, 32), 2, 48, tier=128, gain=1.12), Row((33, 64), 0, 0, tier=64, gain=1.0)],
            window=1000.0, margin=0.02)
    return make_profile(
        params, w,
        hardware=Hardware(gpu="NVIDIA H200", capability="9.0", driver="580.159.04", power_limit_w=700),
        software=Software(spectune="0.1.0", torch="2.11.0", triton="3.6.0"),
        error=CostError(held_out=6, median_rel=0.021, max_rel=0.06),
        capture=[CapturePoint(64, 1.2, 310.0), CapturePoint(128, 1.3, 420.0), CapturePoint(256, 1.5, 610.0)],
        points=points,
        policy=policy,
    )


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    policy = root / "h200_policy.yaml"
    write_table(make_table(), policy)
    out = root / "out"
    assert main(["report", str(BENCH), str(policy), "--out", str(out)]) == 0
    return out


def _md_row(md: str, first: str) -> list[str]:
    for line in md.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] == first:
            return cells
    raise AssertionError(f"no table row starting with {first!r}")


def _rs(rows: list[dict]) -> ResultSet:
    return ResultSet("t", "t", "t.json", "bench", {},
                     tuple(BenchRow(**{"output_tok_s": 0.0, **r}) for r in rows))


# ---------------------------------------------------------------------------------------------
# the whole report


def test_report_files_and_pngs_are_valid(built):
    names = {p.name for p in built.iterdir()}
    assert {"report.md", "report.html"} <= names
    pngs = sorted(p for p in built.iterdir() if p.suffix == ".png")
    assert {p.name for p in pngs} == {"bench_small_goodput.png", "bench_small_power.png", "bench_small_latency.png",
                                      "bench_small_itl_cdf.png", "k_vs_batch.png", "h200_policy_costs.png"}
    for p in pngs:
        with Image.open(p) as im:
            im.verify()
        with Image.open(p) as im:
            assert im.format == "PNG" and im.size[0] > 300 and im.size[1] > 200
    assert not [p for p in built.parent.iterdir() if p.name.startswith(".")]  # no temp folder left


def test_markdown_ab_table_numbers_and_bold(built):
    md = (built / "report.md").read_text(encoding="utf-8")
    head = _md_row(md, "concurrency")
    assert head == ["concurrency", "plain", "fixed:3", "fixed:7", "auto", "auto / best other", "auto / plain"]
    assert _md_row(md, "1") == ["1", "191.4", "362.8", "391.2", "**396.5**", "1.014x", "2.072x"]
    # at 64 plain wins: bold moves to plain and auto / best other drops below 1
    assert _md_row(md, "64") == ["64", "**7406.3**", "6110.8", "4188.4", "7351.6", "0.993x", "0.993x"]
    assert "WARNING" not in md  # gpu_idle alone is not throttling


def test_markdown_sections(built):
    md = (built / "report.md").read_text(encoding="utf-8")
    for text in ("- **gpu**: NVIDIA H200", "- **driver**: 580.159.04", "- **date**: 2026-03-02T14:05:11Z",
                 "- **target**: qwen3-8b", "- **drafter**: eagle-1l", "### Exactness", "### Simulator vs measured",
                 "### Chosen K", "### Policy rows", "### Graph capture per tier", "![Goodput vs concurrency]"):
        assert text in md
    assert _md_row(md, "auto")[:4] == ["auto", "688", "0", "0"]  # exactness: totals per arm
    assert _md_row(md, "1-4") == ["1-4", "7", "20", "64", "2.010x"]
    for name in (p.name for p in built.glob("*.png")):
        assert f"]({name})" in md
    # cost model vs measured points: the fixture's wobble is 1.03, 0.98, 1.01, 0.96, 1.02
    kinds = {_md_row(md, k)[0]: _md_row(md, k) for k in ("target", "tier", "drafter", "overhead")}
    assert kinds["target"][1] == "16" and kinds["drafter"][1] == "6" and kinds["tier"][1] == "3"


def test_html_is_self_contained(built):
    page = (built / "report.html").read_text(encoding="utf-8")
    srcs = re.findall(r'src="([^"]*)"', page)
    assert len(srcs) == len(list(built.glob("*.png")))
    assert all(s.startswith("data:image/png;base64,") for s in srcs)
    assert "<link" not in page and "<script" not in page and "href=" not in page and "url(" not in page
    embedded = {base64.b64decode(s.split(",", 1)[1]) for s in srcs}
    assert embedded == {p.read_bytes() for p in built.glob("*.png")}
    with Image.open(io.BytesIO(next(iter(embedded)))) as im:
        assert im.format == "PNG"
    assert "<b>7406.3</b>" in page and "<b>396.5</b>" in page


# ---------------------------------------------------------------------------------------------
# tables


def test_ab_table_ties_missing_cells_and_no_plain():
    t = ab_table(_rs([{"concurrency": 2, "arm": "fixed:3", "output_tok_s": 10.0},
                      {"concurrency": 2, "arm": "auto", "output_tok_s": 10.0},
                      {"concurrency": 8, "arm": "auto", "output_tok_s": 30.0},
                      {"concurrency": 8, "arm": "fixed:12", "output_tok_s": 40.0}]))
    assert t.head == ("concurrency", "fixed:3", "fixed:12", "auto", "auto / best other")  # K sorts numerically
    assert t.rows[0] == (("2", False), ("10.0", True), ("–", False), ("10.0", True), ("1.000x", False))
    assert t.rows[1] == (("8", False), ("–", False), ("40.0", True), ("30.0", False), ("0.750x", False))


def test_decode_throughput_is_compared_when_every_row_has_it():
    rows = [{"concurrency": 1, "arm": "plain", "output_tok_s": 5.0, "decode_tok_s": 6.0},
            {"concurrency": 1, "arm": "auto", "output_tok_s": 4.0, "decode_tok_s": 12.0}]
    rs = _rs(rows)
    assert rate_field(rs) == "decode_tok_s"
    t = ab_table(rs, rate_field(rs))
    assert t.rows[0] == (("1", False), ("6.0", False), ("12.0", True), ("2.000x", False), ("2.000x", False))
    assert "decode tok/s" in t.caption
    assert rate_field(_rs([rows[0], {"concurrency": 1, "arm": "auto", "output_tok_s": 4.0}])) == "output_tok_s"


def test_ab_table_without_auto_has_no_ratios():
    t = ab_table(_rs([{"concurrency": 1, "arm": "plain", "output_tok_s": 5.0},
                      {"concurrency": 1, "arm": "fixed:2", "output_tok_s": 7.0}]))
    assert t.head == ("concurrency", "plain", "fixed:2")
    assert t.rows[0][2] == ("7.0", True)


def test_exactness_and_prediction_tables():
    rs = _rs([{"concurrency": 1, "arm": "auto", "output_tok_s": 100.0, "completed": 5, "failed": 1,
               "mismatches": 0, "predicted_tok_s": 110.0},
              {"concurrency": 4, "arm": "auto", "output_tok_s": 200.0, "completed": 7, "failed": 0,
               "mismatches": 2, "predicted_tok_s": 190.0},
              {"concurrency": 4, "arm": "plain", "output_tok_s": 150.0}])
    ex = exactness_table(rs)
    assert ex is not None
    assert ex.rows[0] == (("plain", False), ("–", False), ("–", False), ("–", False))
    assert ex.rows[1] == (("auto", False), ("12", False), ("1", True), ("2", True))
    pred = prediction_table(rs)
    assert pred is not None
    table, summary = pred
    assert [r[4][0] for r in table.rows] == ["+10.0%", "-5.0%"]
    assert "median 10.0%" in summary and "max 10.0%" in summary


def test_cost_model_point_errors_match_the_known_wobble():
    tab = make_table()
    errs = {k: (n, med, mx) for k, n, med, mx in point_errors(tab)}
    assert set(errs) == {"target", "tier", "drafter", "overhead"}
    assert errs["target"][0] == 16  # the infeasible point is left out
    assert errs["target"][2] == pytest.approx(1 / 0.96 - 1)  # |model / measured - 1|, worst wobble
    assert errs["tier"][1] == pytest.approx(1 / 0.98 - 1)  # tier wobbles 1.03, 0.98, 1.01 -> middle one
    model = CostModel(tab.costs.model, "autoregressive", 2048)
    p = tab.costs.points[0]
    assert p.ms is not None and predicted_ms(model, p) == pytest.approx(p.ms / 1.03)


def test_cost_plot_of_many_batch_sizes_keeps_its_axes():
    # a real profile measures dozens of batch sizes: a legend entry per batch outgrew the panel,
    # constrained layout gave up (a raw UserWarning on stderr) and squashed the axes to a strip
    import warnings

    from spectune.autotune.report_plots import cost_png

    tab = make_table()
    model = CostModel(tab.costs.model, "autoregressive", 2048)
    many = [Point("target", b, b * q, model.target_ms(b * q, b), q=q) for b in range(1, 29) for q in (1, 4)]
    many += [Point("drafter", b, b * 3, model.drafter_ms(b, 3), k=3) for b in (1, 2, 4, 8, 16, 32, 64, 128)]
    tab = replace(tab, costs=replace(tab.costs, points=[*tab.costs.points, *many]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        png = cost_png(tab)
    with Image.open(io.BytesIO(png)) as im:
        assert im.format == "PNG" and im.size == (round(4.6 * 4 * 100), 380)


# ---------------------------------------------------------------------------------------------
# warnings, tolerance, other inputs


def test_throttle_failures_and_mismatches_are_visible(tmp_path):
    data = json.loads(BENCH.read_text())
    data["rows"][5]["throttle_reasons"] = ["sw_power_cap", "gpu_idle"]
    data["rows"][6]["failed"] = 2
    data["rows"][7]["mismatches"] = 1
    bench = tmp_path / "hot.json"
    bench.write_text(json.dumps(data))
    report = build_report(load_inputs([bench]))
    assert len(report.warnings) == 3
    assert any("sw_power_cap" in w and "gpu_idle" not in w for w in report.warnings)
    top = report.markdown.split("## Bench")[0]
    assert top.count("> **WARNING**") == 3  # listed at the top, not only in the section
    assert _md_row(report.markdown, "fixed:7")[2:4] == ["**2**", "0"]
    assert 'class="warn"' in report.html


def test_minimal_rows_are_tolerated(tmp_path):
    bench = tmp_path / "minimal.json"
    bench.write_text(json.dumps({"rows": [
        {"concurrency": c, "arm": a, "output_tok_s": v, "future_field": {"x": 1}}
        for c, a, v in ((1, "plain", 100.0), (1, "auto", 180.0), (8, "plain", 700.0), (8, "auto", 900.0))]}))
    profile = tmp_path / "profile.yaml"
    write_table(make_table(with_policy=False, with_points=False), profile)
    report, files = write_report_and_list(tmp_path / "out", [bench, profile])
    assert sorted(report.images) == ["minimal_goodput.png", "profile_costs.png"]  # nothing else to draw
    assert _md_row(report.markdown, "8") == ["8", "700.0", "**900.0**", "1.286x", "1.286x"]
    assert "### Exactness" not in report.markdown and "### Policy rows" not in report.markdown
    assert all(f.exists() for f in files)


def test_goodput_alias_and_throttled_profile_points(tmp_path):
    sim = tmp_path / "sim_rows.json"
    sim.write_text(json.dumps({"header": {"kind": "simulation"},
                               "rows": [{"concurrency": 4, "arm": "auto", "goodput_tok_s": 812.5}]}))
    (rs,) = load_inputs([sim]).results
    assert rs.kind == "sim" and rs.rows[0].output_tok_s == 812.5
    tab = make_table()
    hot = [replace(p, throttle=0x4 | 0x1) if i < 3 else p for i, p in enumerate(tab.costs.points)]
    profile = tmp_path / "hot.yaml"
    write_table(replace(tab, costs=replace(tab.costs, points=hot)), profile)
    (t,) = load_inputs([profile]).tables
    assert table_warnings(t) == [f"hot.yaml: 3 of {len(hot)} cost points measured while the GPU was throttled"]
    assert table_warnings(load_inputs([DATA / "policy_small.yaml"]).tables[0]) == []


@pytest.mark.parametrize("prompt_len", [None, 64])
def test_simulate_json_is_reported_as_a_simulation(tmp_path, capsys, prompt_len):
    # `spectune simulate --json` writes output_tok_s: null without --prompt-len (not measured):
    # the report shows its goodput as decode tok/s and leaves the end-to-end table out
    from tests.engine.test_engine import write_policy

    policy = write_policy(tmp_path / "p.yaml")
    argv = ["simulate", str(policy), "--acceptance", "curve:0.5,0.25,0.12", "--concurrency", "2,4",
            "--arms", "plain,fixed:2,auto", "--requests", "8", "--repeats", "1", "--json"]
    assert main(argv + ([] if prompt_len is None else ["--prompt-len", str(prompt_len)])) == 0
    sim = tmp_path / "sim.json"
    sim.write_text(capsys.readouterr().out)
    data = json.loads(sim.read_text())
    assert main(["report", str(sim), "--out", str(tmp_path / "r")]) == 0
    md = (tmp_path / "r" / "report.md").read_text(encoding="utf-8")
    assert "## Simulation: sim.json" in md and "## Bench" not in md
    assert "- **acceptance**: curve:0.5,0.25,0.12" in md  # the simulation's settings as its header
    goodput = {r["arm"]: r["goodput_tok_s"] for r in data["rows"] if r["concurrency"] == 4}
    assert _md_row(md.split("### A/B: output")[0], "4")[1] == f"{goodput['plain']:.1f}"  # decode table
    assert ("### A/B: output tok/s" in md) == (prompt_len is not None)
    if prompt_len is not None:
        e2e = {r["arm"]: r["output_tok_s"] for r in data["rows"] if r["concurrency"] == 4}
        assert _md_row(md.split("### A/B: output")[1], "4")[1] == f"{e2e['plain']:.1f}"
    (rs,) = load_inputs([sim]).results
    assert rs.kind == "sim" and {r.output_tok_s is None for r in rs.rows} == {prompt_len is None}


def test_null_output_is_a_dash_where_other_rows_have_it():
    rs = _rs([{"concurrency": 1, "arm": "plain", "output_tok_s": None, "decode_tok_s": 5.0},
              {"concurrency": 1, "arm": "auto", "output_tok_s": 8.0, "decode_tok_s": 9.0},
              {"concurrency": 2, "arm": "auto", "output_tok_s": None, "decode_tok_s": 9.0,
               "predicted_tok_s": 10.0}])
    t = ab_table(rs)
    assert t.rows[0] == (("1", False), ("–", False), ("8.0", True), ("–", False), ("–", False))
    assert t.rows[1] == (("2", False), ("–", False), ("–", False), ("–", False), ("–", False))
    pred = prediction_table(rs)
    assert pred is not None and pred[0].rows[0][2:] == (("9.0", False), ("10.0", False), ("+11.1%", False))


def write_report_and_list(out, paths):
    report = build_report(load_inputs(paths))
    return report, write_report(report, out)


def test_simulation_json_from_the_benchmark_script(tmp_path):
    def row(c, plain, fixed, pol, uni):
        best = max(fixed, key=lambda k: fixed[k])
        return {"concurrency": c, "plain": plain, "fixed": {str(k): v for k, v in fixed.items()}, "best_k": best,
                "policy": pol, "policy_uniform_alloc": uni, "vs_best": pol / fixed[best], "vs_plain": pol / plain}
    rows = [row(1, 200.0, {0: 200.0, 1: 300.0, 3: 380.0, 5: 390.0}, 395.0, 392.0),
            row(32, 6000.0, {0: 6000.0, 1: 6300.0, 3: 5800.0, 5: 4000.0}, 6350.0, 6200.0)]
    sim = tmp_path / "sim_h200.json"
    sim.write_text(json.dumps({"profile": "p.yaml", "acceptance": "curve:0.8", "mean": rows, "heterogeneous": rows}))
    inputs = load_inputs([sim])
    assert [rs.name for rs in inputs.results] == ["Simulation: mean (sim_h200.json)",
                                                  "Simulation: heterogeneous (sim_h200.json)"]
    rs = inputs.results[0]
    assert rs.arms == ["plain", "fixed:1", "fixed:5", "auto", "auto:uniform"]  # best fixed K of some row
    t = ab_table(rs)
    assert t.rows[1] == (("32", False), ("6000.0", False), ("6300.0", False), ("4000.0", False),
                         ("6350.0", True), ("6200.0", False), ("1.008x", False), ("1.058x", False))


# ---------------------------------------------------------------------------------------------
# errors: one line, exit 2, nothing written


def _bad_rows(mutate):
    data = json.loads(BENCH.read_text())
    mutate(data)
    return json.dumps(data)


@pytest.mark.parametrize("text, field", [
    (_bad_rows(lambda d: d["rows"][2].update(output_tok_s="fast")), "rows[2].output_tok_s"),
    (_bad_rows(lambda d: d["rows"][2].update(output_tok_s=None)), "rows[2].output_tok_s: must not be null"),
    ('{"rows": [{"concurrency": 1, "arm": "plain", "goodput_tok_s": null, "output_tok_s": null}]}',
     "rows[0].output_tok_s: must not be null"),
    (_bad_rows(lambda d: d["rows"][0].pop("arm")), "rows[0].arm: missing"),
    (_bad_rows(lambda d: d["rows"][3].update(concurrency=0)), "rows[3].concurrency"),
    (_bad_rows(lambda d: d["rows"][4].update(k_hist={"seven": 3})), "rows[4].k_hist.seven"),
    (_bad_rows(lambda d: d["rows"][1].update(itl_ms=[1.0, -2.0])), "rows[1].itl_ms"),
    (_bad_rows(lambda d: d["rows"].append(dict(d["rows"][0]))), "duplicate row"),
    (_bad_rows(lambda d: d.update(header=["gpu"])), "header: must be a mapping"),
    (_bad_rows(lambda d: d.update(rows=[])), "rows: must be a non-empty list"),
    ('{"rows": [{"concurrency": 1, "arm": "plain", "output_tok_s": NaN}]}', "rows[0].output_tok_s"),
    ('{"header": {"gpu": "x"}}', "not a results file"),
    ('{"rows": [1, 2', "not valid JSON"),
])
def test_malformed_results_exit_2_one_line_and_no_output(tmp_path, capsys, text, field):
    bad = tmp_path / "bad.json"
    bad.write_text(text)
    out = tmp_path / "out"
    assert main(["report", str(BENCH), str(bad), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert str(bad) in err and field in err
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.json"]


def test_bad_table_and_unknown_input_exit_2(tmp_path, capsys):
    table = tmp_path / "t.yaml"
    table.write_text((DATA / "policy_small.yaml").read_text().replace("max_k: 7", "max_k: -1"))
    assert main(["report", str(table), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "workload.max_k" in err and "t.yaml" in err
    other = tmp_path / "x.csv"
    other.write_text("a,b\n")
    assert main(["report", str(other), "--out", str(tmp_path / "out")]) == 2
    assert "x.csv" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_rewrite_into_existing_folder_replaces_files(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    (out / "report.md").write_text("old")
    bench = tmp_path / "b.json"
    bench.write_text(json.dumps({"rows": [{"concurrency": 1, "arm": "plain", "output_tok_s": 1.0}]}))
    report, files = write_report_and_list(out, [bench])
    assert (out / "report.md").read_text() == report.markdown
    assert (out / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.json", "out"]
    assert [f.name for f in files][-2:] == ["report.html", "report.md"]


def test_out_that_is_a_file_is_refused(tmp_path, capsys):
    out = tmp_path / "out"
    out.write_text("x")
    assert main(["report", str(BENCH), "--out", str(out)]) == 2
    assert "not a folder" in capsys.readouterr().err


def test_timed_out_runs_are_warned():
    from spectune.autotune.report import result_warnings
    from spectune.autotune.report_inputs import BenchRow, ResultSet

    rows = (BenchRow(concurrency=4, arm="auto", output_tok_s=1.0, timed_out=True, repeat=2),
            BenchRow(concurrency=4, arm="plain", output_tok_s=1.0, timed_out=False, repeat=2))
    warnings = result_warnings(ResultSet("b", "b", "b.json", "bench", {}, rows))
    assert warnings == ["b.json: concurrency 4, arm auto (repeat 2): timed out at the time limit"]
