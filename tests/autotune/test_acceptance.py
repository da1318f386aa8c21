import gzip
import json
import warnings
from pathlib import Path

import numpy as np
import pytest

from spectune.autotune.acceptance import (
    EXTRAPOLATION_DECAY,
    AcceptanceError,
    AcceptanceModel,
    Component,
    default_acceptance,
    load_acceptance,
)
from spectune.autotune.acceptance_sources import calibrate, read_traces
from spectune.errors import TableError

DATA = Path(__file__).parent / "data"
PROM = DATA / "vllm_metrics.prom"


# ---------------------------------------------------------------------------------------------
# curve: and the model


def test_curve_survival_and_tokens():
    m = load_acceptance("curve:0.78,0.58,0.43", max_k=5)
    assert m.max_k == 5 and len(m.components) == 1
    assert m.mean_survival(3) == pytest.approx([0.78, 0.58, 0.43])
    assert m.expected_tokens(3) == pytest.approx(1 + 0.78 + 0.58 + 0.43)
    # past the data: last conditional rate, decayed geometrically
    a3 = 0.43 / 0.58
    assert m.components[0].accept[3] == pytest.approx(a3 * EXTRAPOLATION_DECAY)
    assert m.components[0].accept[4] == pytest.approx(a3 * EXTRAPOLATION_DECAY**2)
    s = m.mean_survival(5)
    assert all(x >= y for x, y in zip(s, s[1:], strict=False))


@pytest.mark.parametrize(
    "spec, needle",
    [
        ("curve:0.8,1.2,0.3", "position 2"),  # out of [0, 1]
        ("curve:0.8,0.5,0.6", "position 3"),  # increasing
        ("curve:0.8,abc", "position 2"),  # not a number
        ("curve:0.8,nan", "position 2"),
        ("curve:", "no survival values"),
    ],
)
def test_curve_rejects_bad_values(spec, needle):
    with pytest.raises(AcceptanceError, match=needle):
        load_acceptance(spec, max_k=4)


def test_unknown_source_lists_forms():
    with pytest.raises(AcceptanceError, match="unknown acceptance source.*curve:"):
        load_acceptance("bogus", max_k=4)


def test_mixture_inline():
    m = load_acceptance("mixture:0.25*curve(0.95,0.9)+0.75*curve(0.5,0.2)", max_k=3)
    assert [c.weight for c in m.components] == pytest.approx([0.25, 0.75])
    assert m.mean_survival(2) == pytest.approx([0.25 * 0.95 + 0.75 * 0.5, 0.25 * 0.9 + 0.75 * 0.2])
    with pytest.raises(AcceptanceError, match="sum to 1"):
        load_acceptance("mixture:0.5*curve(0.9)+0.4*curve(0.5)", max_k=3)
    with pytest.raises(AcceptanceError, match="term 2"):
        load_acceptance("mixture:0.5*curve(0.9)+0.5*kurve(0.5)", max_k=3)


@pytest.mark.parametrize("spread, w", [(0.5, 0.5), (1.0, 0.3), (0.8, 0.7)])
def test_mixture_with_same_mean_keeps_mean(spread, w):
    curve = [0.8, 0.6, 0.45, 0.3]
    m = AcceptanceModel.mixture_with_same_mean(curve, max_k=6, spread=spread, easy_weight=w)
    base = load_acceptance("curve:" + ",".join(map(str, curve)), max_k=6)
    assert m.mean_survival(6) == pytest.approx(base.mean_survival(6), abs=1e-9)
    easy, hard = (c.survival(6) for c in m.components)
    assert all(e > h for e, h in zip(easy, hard, strict=True))  # really two classes
    for s in (easy, hard):
        assert all(0 <= y <= x <= 1 for x, y in zip(s, s[1:], strict=False))


def test_sample_picks_components_by_weight():
    m = AcceptanceModel(
        source="test",
        components=(Component(0.3, (0.9, 0.9)), Component(0.7, (0.2, 0.1))),
        max_k=2,
    )
    rows = m.sample(np.random.default_rng(0), 4000)
    assert rows.shape == (4000, 2)
    easy = np.mean(rows[:, 0] == 0.9)
    assert abs(easy - 0.3) < 0.03
    assert set(map(tuple, rows.tolist())) == {(0.9, 0.9), (0.2, 0.1)}


def test_dict_round_trip_and_errors():
    m = AcceptanceModel.mixture_with_same_mean([0.8, 0.6], max_k=4)
    m = AcceptanceModel(m.source, m.components, m.max_k, calibration=((0.5, 0.3), (1.0, 0.8)))
    assert AcceptanceModel.from_dict(m.to_dict()) == m
    bad = m.to_dict()
    bad["components"][0]["accept"][1] = 1.5
    with pytest.raises(TableError, match=r"acceptance\.components\[0\]\.accept\[1\]"):
        AcceptanceModel.from_dict(bad)
    bad = m.to_dict()
    bad["components"][0]["weight"] = 0.9
    with pytest.raises(TableError, match=r"acceptance\.components: weights sum"):
        AcceptanceModel.from_dict(bad)
    bad = m.to_dict()
    bad["max_k"] = 5
    with pytest.raises(TableError, match=r"components\[0\]\.accept: has 4 positions"):
        AcceptanceModel.from_dict(bad)
    with pytest.raises(TableError, match=r"acceptance\.extra"):
        AcceptanceModel.from_dict({**m.to_dict(), "extra": 1})


# ---------------------------------------------------------------------------------------------
# public figures


@pytest.mark.parametrize("drafter", ["EAGLE-3", "EAGLE-1"])
def test_public_fit_reproduces_published_lengths(drafter):
    published = {2: 2.36, 3: 2.79, 4: 3.08, 5: 3.32, 6: 3.46, 7: 3.54}
    if drafter == "EAGLE-1":
        published = {2: 2.10, 3: 2.29, 4: 2.39, 5: 2.43, 6: 2.45, 7: 2.47}
    m = load_acceptance(f"public:{drafter}/Llama-3.1-8B-Instruct/MT-Bench", max_k=10)
    for k, length in published.items():
        assert m.expected_tokens(k) == pytest.approx(length, rel=0.03)
    assert "residual" in m.source


def test_public_per_position_is_survival():
    m = load_acceptance("public:ngram+EAGLE hybrid/unknown/unknown", max_k=5)
    assert m.mean_survival(3) == pytest.approx([0.77, 0.45, 0.24])


def test_public_unknown_selector_lists_available():
    with pytest.raises(AcceptanceError, match="available:.*EAGLE-3/Llama-3.1-8B-Instruct/MT-Bench"):
        load_acceptance("public:EAGLE-9/x/y", max_k=5)


def test_default_acceptance_is_eagle3_row():
    m = default_acceptance(7)
    assert "EAGLE-3/Llama-3.1-8B-Instruct/MT-Bench" in m.source
    assert m.expected_tokens(4) == pytest.approx(3.08, rel=0.03)


# ---------------------------------------------------------------------------------------------
# vLLM metrics


def test_metrics_fixture_fixed_k():
    m = load_acceptance(str(PROM), max_k=6)
    # summed over two engines: per-position / drafts
    assert m.mean_survival(3) == pytest.approx([0.78, 0.58, 0.42])
    assert "K=3 fixed" in m.source
    assert load_acceptance(f"metrics:{PROM}", max_k=6).mean_survival(3) == pytest.approx([0.78, 0.58, 0.42])


def _scrape(per_pos, drafts, draft_tokens, model="m1", suffix="_total", typed=False):
    lines = []
    for name, value in (("num_drafts", drafts), ("num_draft_tokens", draft_tokens), ("num_accepted_tokens", sum(per_pos))):
        if typed:
            lines.append(f"# TYPE vllm:spec_decode_{name}{suffix} counter")
        lines.append(f'vllm:spec_decode_{name}{suffix}{{engine="0",model_name="{model}"}} {value}')
    for i, c in enumerate(per_pos):
        lines.append(f'vllm:spec_decode_num_accepted_tokens_per_pos{suffix}{{engine="0",model_name="{model}",position="{i}"}} {c}')
    return "\n".join(lines) + "\n"


def test_metrics_without_total_suffix_or_type(tmp_path):
    f = tmp_path / "scrape.txt"
    f.write_text(_scrape([80, 50], 100, 200, suffix=""))
    assert load_acceptance(str(f), max_k=2).mean_survival(2) == pytest.approx([0.8, 0.5])


def test_metrics_errors(tmp_path):
    empty = tmp_path / "empty.prom"
    empty.write_text('# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine="0"} 1.0\n')
    with pytest.raises(AcceptanceError, match="no vLLM spec-decode series"):
        load_acceptance(str(empty), max_k=3)
    two = tmp_path / "two.prom"
    two.write_text(_scrape([80, 50], 100, 200, model="a") + _scrape([60, 30], 100, 200, model="b"))
    with pytest.raises(AcceptanceError, match="several models.*#model=NAME"):
        load_acceptance(str(two), max_k=3)
    assert load_acceptance(f"metrics:{two}#model=b", max_k=2).mean_survival(2) == pytest.approx([0.6, 0.3])
    with pytest.raises(AcceptanceError, match="model_name='c'"):
        load_acceptance(f"metrics:{two}#model=c", max_k=2)
    with pytest.raises(AcceptanceError, match="cannot read"):
        load_acceptance(str(tmp_path / "missing.prom"), max_k=2)
    with pytest.raises(AcceptanceError, match="cannot fetch"):
        load_acceptance("http://127.0.0.1:9/metrics", max_k=2)


def test_metrics_variable_k_refused_or_exact_with_two_ks(tmp_path):
    # 100 steps: 80 offered 3 drafts, 20 offered 2; true survival 0.8, 0.6, 0.4
    per_pos = [80, 60, 0.4 * 80]
    f = tmp_path / "var.prom"
    f.write_text(_scrape(per_pos, 100, 80 * 3 + 20 * 2, typed=True))
    with pytest.raises(AcceptanceError, match="averaged 2.80 of at most 3.*#ks=") as err:
        load_acceptance(str(f), max_k=3)
    assert "\n" not in str(err.value)
    m = load_acceptance(f"metrics:{f}#ks=3,2", max_k=3)
    assert m.mean_survival(3) == pytest.approx([0.8, 0.6, 0.4])
    assert "2x20/3x80" in m.source


# ---------------------------------------------------------------------------------------------
# traces


def _write_traces(path, records):
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wt") as fh:
        for rec in records:
            fh.write(json.dumps(rec) + "\n")


def _two_class_traces(rng, n_req=240, steps=40):
    classes = [(0.6, 0.9), (0.4, 0.35)]  # (weight, conditional rate at every position)
    records = []
    for r in range(n_req):
        rate = classes[0][1] if rng.random() < classes[0][0] else classes[1][1]
        for step in range(steps):
            offered = int(rng.integers(3, 7))
            accepted = 0
            while accepted < offered and rng.random() < rate:
                accepted += 1
            records.append({"request": f"r{r}", "step": step, "offered": offered, "accepted": accepted,
                            "dataset": "synthetic"})
    return records


def test_traces_recover_two_classes(tmp_path):
    path = tmp_path / "two.jsonl.gz"
    _write_traces(path, _two_class_traces(np.random.default_rng(1)))
    m = load_acceptance(f"{path}#declined=offered", max_k=6)  # the rates of the drafts offered
    assert len(m.components) == 2
    easy, hard = m.components
    assert easy.weight == pytest.approx(0.6, abs=0.08)
    assert np.mean(easy.accept[:4]) == pytest.approx(0.9, abs=0.04)
    assert np.mean(hard.accept[:3]) == pytest.approx(0.35, abs=0.05)
    assert "240 requests" in m.source
    assert m.calibration is None
    # per planned draft (the default): every step offered positions 1..3, so they read alike;
    # position 4 was declined in a quarter of the steps, a rejection there
    planned = load_acceptance(str(path), max_k=6)
    easy_planned = planned.components[0]
    assert easy_planned.accept[:3] == pytest.approx(easy.accept[:3], abs=0.02)
    assert easy_planned.accept[3] == pytest.approx(0.75 * easy.accept[3], abs=0.05)


def test_traces_homogeneous_gives_one_class(tmp_path):
    rng = np.random.default_rng(2)
    records = []
    for r in range(100):
        for step in range(20):
            accepted = 0
            while accepted < 4 and rng.random() < 0.7:
                accepted += 1
            records.append({"request": r, "step": step, "offered": 4, "accepted": accepted})
    path = tmp_path / "one.jsonl"
    _write_traces(path, records)
    m = load_acceptance(f"traces:{path}", max_k=4)
    assert len(m.components) == 1
    assert m.components[0].accept == pytest.approx((0.7,) * 4, abs=0.04)


def test_traces_with_declined_drafts_say_how_the_declined_drafts_were_read(tmp_path):
    # an n-gram drafter offers nothing on a quarter of the steps and 2 of 4 on an eighth: the
    # source says how the declined drafts were read (per planned draft by default) and their shares
    records = [{"request": r, "step": s, "offered": 0 if s % 4 == 0 else 2 if s % 8 == 1 else 4, "accepted": 0}
               for r in range(10) for s in range(16)]
    path = tmp_path / "ngram.jsonl"
    _write_traces(path, records)
    src = load_acceptance(str(path), max_k=4).source
    assert src.endswith("; per planned draft, a declined one rejected: 25% of steps offered none, "
                        "12% fewer than 4)"), src
    src = load_acceptance(f"{path}#declined=offered", max_k=4).source
    assert src.endswith("; per offered draft: 25% of steps offered none, 12% fewer than 4)"), src
    full = tmp_path / "full.jsonl"
    _write_traces(full, [{**r, "offered": 4} for r in records])
    assert "draft" not in load_acceptance(str(full), max_k=4).source


def test_a_declined_draft_is_a_rejection_per_planned_draft_and_absent_per_offered_draft(tmp_path):
    # request a: offered 0 (declined at position 1), offered 2 and both accepted (position 3
    # declined), offered 4 and 1 accepted; the set's K is 4
    records = [{"request": "a", "step": 0, "offered": 0, "accepted": 0},
               {"request": "a", "step": 1, "offered": 2, "accepted": 2},
               {"request": "a", "step": 2, "offered": 4, "accepted": 1}]
    path = tmp_path / "t.jsonl"
    _write_traces(path, records)
    planned = read_traces(str(path), max_k=4)
    assert planned.trials[0].tolist() == [3, 2, 1, 0] and planned.successes[0].tolist() == [2, 1, 0, 0]
    offered = read_traces(str(path), max_k=4, declined="offered")
    assert offered.trials[0].tolist() == [2, 2, 0, 0] and offered.successes[0].tolist() == [2, 1, 0, 0]


def test_per_planned_traces_read_as_a_copy_whose_every_step_offered_the_set_k(tmp_path):
    # the default model equals the per-offered model of a copy in which every step offered the
    # set's K (what benchmarks/sim_declined_drafts.py writes): a declined draft reads as the
    # first rejection, so the engine's counters and the simulator's model agree
    rng = np.random.default_rng(5)
    records = []
    for r in range(40):
        easy = r % 2 == 0
        for s in range(30):
            offered = int(rng.choice([0, 2, 5], p=[0.3, 0.1, 0.6]))
            accepted = 0
            while accepted < offered and rng.random() < (0.8 if easy else 0.4):
                accepted += 1
            records.append({"request": r, "step": s, "offered": offered, "accepted": accepted})
    path, copy = tmp_path / "t.jsonl", tmp_path / "copy.jsonl"
    _write_traces(path, records)
    _write_traces(copy, [{**rec, "offered": 5} for rec in records])
    a = load_acceptance(str(path), max_k=5)
    b = load_acceptance(f"traces:{copy}#declined=offered", max_k=5)
    assert [c.weight for c in a.components] == pytest.approx([c.weight for c in b.components])
    assert [c.accept for c in a.components] == [c.accept for c in b.components]
    per_offered = load_acceptance(f"{path}#declined=offered", max_k=5)
    assert a.expected_tokens(5) < per_offered.expected_tokens(5) - 0.2


@pytest.mark.parametrize("selector", ["#declined=maybe", "#model=x", "#declined"])
def test_a_trace_selector_that_is_not_declined_is_refused_naming_the_file(tmp_path, selector):
    path = tmp_path / "t.jsonl"
    _write_traces(path, [{"request": "a", "step": 0, "offered": 2, "accepted": 1}])
    with pytest.raises(AcceptanceError, match=r"t\.jsonl: unknown selector .*#declined=rejected or #declined=offered"):
        load_acceptance(f"{path}{selector}", max_k=4)


def test_calibration_monotone_and_close(tmp_path):
    rng = np.random.default_rng(3)
    records = []
    for r in range(60):
        for step in range(30):
            conf = rng.random(4).round(4).tolist()
            accepted = 0
            while accepted < 4 and rng.random() < conf[accepted]:
                accepted += 1
            records.append({"request": r, "step": step, "offered": 4, "accepted": accepted, "conf": conf})
    path = tmp_path / "conf.jsonl"
    _write_traces(path, records)
    m = load_acceptance(str(path), max_k=4)
    assert m.calibration is not None
    probs = [p for _, p in m.calibration]
    assert probs == sorted(probs)
    for edge, p in m.calibration:
        assert p == pytest.approx(edge - 0.05, abs=0.1)


def test_calibrate_pools_violators():
    conf = np.array([0.05, 0.05, 0.15, 0.15, 0.95])
    ok = np.array([True, True, False, False, True])
    cal = calibrate(conf, ok)
    assert [p for _, p in cal] == [0.5, 0.5, 1.0]


BAD_LINES = [
    ('{"step": 1, "offered": 2, "accepted": 1}', "missing field 'request'"),
    ('{"request": "a", "step": 1, "offered": 2, "accepted": 3}', "field 'accepted' \\(3\\) exceeds 'offered' \\(2\\)"),
    ('{"request": "a", "step": 1, "offered": "2", "accepted": 1}', "field 'offered' must be an integer"),
    ('{"request": "a", "step": 1, "offered": 2, "accepted": 1, "conf": [0.5]}', "field 'conf' must be a list of 2"),
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
]


@pytest.mark.parametrize("line, needle", BAD_LINES)
def test_traces_malformed_line_named(tmp_path, line, needle):
    good = [json.dumps({"request": "a", "step": i, "offered": 3, "accepted": 1}) for i in range(6)]
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(good + [line]) + "\n")
    with pytest.raises(AcceptanceError, match=f"bad.jsonl:7: {needle}"):
        load_acceptance(str(path), max_k=3)


def test_traces_missing_file_and_empty(tmp_path):
    with pytest.raises(AcceptanceError, match="cannot read"):
        load_acceptance(str(tmp_path / "none.jsonl"), max_k=3)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(AcceptanceError, match="no trace records"):
        load_acceptance(str(empty), max_k=3)


def test_no_warning_for_fixed_k_metrics():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_acceptance(str(PROM), max_k=3)
