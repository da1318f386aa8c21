import json

import pytest

from spectune.autotune.acceptance import AcceptanceModel
from spectune.autotune.policy_search import SearchError, capture_costs, search_policy, tier_universe
from spectune.autotune.tune_pipeline import tune_table
from spectune.cli import main
from spectune.errors import SpectuneError
from spectune.runtime.costs import CostModel
from spectune.runtime.planner import Planner
from spectune.runtime.table import CapturePoint, read_table, write_table
from tests.tables import make_params, make_profile, make_workload

# free up to 40 step tokens, then 1 ms per token; drafts past position 4 are never accepted:
# the best K is 4 while 5b <= 40 (b <= 8) and plain decoding from b = 64
KNEE = make_params((10.0, 0.0, 40, 1.0, 0.0), (0.0, 0.5, 0.0), (0.0, 0.0), (100.0, 300.0, 64))
SMALL = make_params((2.0, 0.01, 64, 0.05, 5.0), (0.02, 0.2, 0.002), (0.05, 0.0))
ACC = AcceptanceModel.from_survival([0.9, 0.8, 0.7, 0.6, 0.0, 0.0], max_k=6, source="test")
CAPTURE = [CapturePoint(1, 0.1, 10.0), CapturePoint(64, 0.2, 30.0), CapturePoint(448, 0.6, 120.0)]


def knee_search(**kw):
    cost = CostModel(KNEE, "autoregressive", 128)
    return search_policy(cost, ACC, max_batch=64, max_k=6, capture=CAPTURE, trials=8, **kw)


def test_recovers_known_optimum_and_covers_rows():
    res = knee_search(seed=1)
    ks = {c.batch: c.k for c in res.choices}
    assert all(ks[b] == 4 for b in range(1, 9))
    assert ks[64] == 0 and res.k0_cutoff <= 64
    rows = res.policy.rows
    assert rows[0].batch[0] == 1 and rows[-1].batch[1] == 64
    assert all(a.batch[1] + 1 == b.batch[0] for a, b in zip(rows, rows[1:], strict=False))
    assert all(c.gain > 1.5 for c in res.choices[:8])
    assert all(c.gain >= 0.99 for c in res.choices if c.batch % 8 == 0)  # tiers without padding
    planner = Planner(_profile(KNEE, 64, 6, policy=res.policy))
    assert planner.plan(8).k == 4 and planner.plan(64).k == 0


def test_reproducible_with_seed_and_budget_respected():
    a = knee_search(seed=3, capture_budget_mib=80.0)
    b = knee_search(seed=3, capture_budget_mib=80.0)
    assert a.policy == b.policy
    assert a.capture_mib <= 80.0
    assert len(a.policy.tiers) < len(knee_search(seed=3).policy.tiers)


def test_capture_interpolation():
    mib, sec = capture_costs(CAPTURE, [1, 32, 64, 832])
    assert mib[0] == pytest.approx(10.0) and mib[2] == pytest.approx(30.0)
    assert 10.0 < mib[1] < 30.0 and mib[3] > 120.0
    assert tier_universe(16, 7)[-1] == 128


def test_batch_one_runs_its_k_in_a_graph_of_exactly_k_plus_one_tokens():
    # every size up to 16 is a candidate tier, as an engine's fixed-K graph at batch 1 is exact:
    # with a per-token cost, the 4 drafts that pay (position 5 is never accepted) run in 5 tokens,
    # not in a padded 6
    assert set(range(1, 17)) <= set(tier_universe(256, 15))
    assert tier_universe(1, 3) == [1, 2, 3, 4]
    cost = CostModel(SMALL, "autoregressive", 128)
    res = search_policy(cost, ACC, max_batch=16, max_k=6, capture=CAPTURE, trials=4, seed=0)
    one = next(c for c in res.choices if c.batch == 1)
    assert one.k == 4 and one.tier == 5
    assert 5 in res.policy.tiers
    assert Planner(_profile(SMALL, 16, 6, policy=res.policy)).plan(1) == (4, 4, 5)


def test_errors_name_the_field():
    cost = CostModel(KNEE, "autoregressive", 128)
    with pytest.raises(SearchError, match="costs.capture"):
        search_policy(cost, ACC, max_batch=8, max_k=6, capture_budget_mib=100.0, trials=2)
    with pytest.raises(SearchError, match="latency"):
        search_policy(cost, ACC, max_batch=8, max_k=6, objective="latency", trials=2)


def test_latency_objective_bounds_step_ms():
    res = knee_search(seed=0, objective="latency", latency_bound_ms=11.0)
    assert all(c.step_ms <= 11.0 or c.k == 0 for c in res.choices)
    assert max(c.k for c in res.choices) <= 2  # K sequential drafter steps cost 0.5 ms each


def test_pareto_front():
    res = knee_search(seed=0, pareto=True)
    assert res.front and res.policy.objective == "pareto"


def _profile(params, max_batch, max_k, policy=None):
    w = make_workload(max_k, max_batch, target="tiny", dtype="float32", context_len=256, device="cpu")
    return make_profile(params, w, timer="wall-clock", capture=CAPTURE, policy=policy)


def test_tune_table_cpu_default(tmp_path):
    table = tune_table(_profile(SMALL, 16, 7), None, trials=10)
    assert table.policy is not None and table.acceptance is not None
    assert AcceptanceModel.from_dict(table.acceptance).max_k == 7
    write_table(table, tmp_path / "p.yaml")
    assert read_table(tmp_path / "p.yaml").policy == table.policy


def test_cli_tune(tmp_path, capsys):
    prof = tmp_path / "profile.yaml"
    write_table(_profile(KNEE, 16, 6), prof)
    out = tmp_path / "policy.yaml"
    rc = main(["tune", str(prof), "--acceptance", "curve:0.9,0.8,0.7,0.6", "--out", str(out), "--trials", "4"])
    assert rc == 0 and read_table(out).policy is not None
    printed = capsys.readouterr().out
    assert "wrote" in printed and "smoothing 0.005" in printed
    rc = main(["tune", str(prof), "--acceptance", "curve:0.9,0.8", "--out", str(out), "--trials", "2",
               "--max-batch", "2", "--search-online"])
    assert rc == 0 and "online: window" in capsys.readouterr().out
    rc = main(["tune", str(prof), "--out", str(out), "--smooth", "1.5"])
    err = capsys.readouterr().err
    assert rc == 2 and "--smooth" in err
    rc = main(["tune", str(prof), "--acceptance", "nonsense", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "acceptance" in err


def test_cli_tune_says_it_uses_drafter_confidences(tmp_path, capsys):
    prof = tmp_path / "profile.yaml"
    write_table(_profile(KNEE, 8, 4), prof)
    traces = tmp_path / "t.jsonl"
    lines = []
    for r in range(4):
        for step in range(10):
            hit = step % 2 == 0  # confident steps accept everything, the others nothing
            lines.append(json.dumps({"request": f"r{r}", "step": step, "offered": 4, "accepted": 4 if hit else 0,
                                     "conf": [0.9] * 4 if hit else [0.1] * 4}))
    traces.write_text("\n".join(lines) + "\n")
    out = tmp_path / "policy.yaml"
    assert main(["tune", str(prof), "--acceptance", str(traces), "--out", str(out), "--trials", "2"]) == 0
    printed = capsys.readouterr().out
    assert "classes of steps by drafter confidence" in printed
    assert "drafter confidences: calibration P(accept | conf bin) <0.2:0.00" in printed
    tuned = AcceptanceModel.from_dict(read_table(out).acceptance)
    assert sorted(round(c.survival(1)[0], 6) for c in tuned.components)[::len(tuned.components) - 1] == [0.0, 1.0]


HETERO = AcceptanceModel.mixture_with_same_mean([0.78, 0.58, 0.43, 0.31, 0.21, 0.14, 0.1], max_k=7, spread=0.9)


@pytest.fixture(scope="module")
def hetero_table():
    return tune_table(_profile(SMALL, 16, 7), HETERO, trials=4)


class TableOnly:
    def __init__(self, table):
        self.planner = Planner(table)

    def plan(self, b):
        return self.planner.plan(b)


def test_policy_tuned_on_the_mixture_beats_every_fixed_k(hetero_table):
    from spectune.autotune.simulator import Mixture, expected_tokens
    from spectune.autotune.tune_pipeline import cost_model
    from spectune.runtime.planner import step_ms

    cost, mix = cost_model(hetero_table), Mixture.of(HETERO)

    def serving(b, k, budget, tier):
        return expected_tokens(mix, b, k, [budget], inflight=True)[0] / step_ms(cost, b, k, tier)

    for b in (1, 2, 4, 8, 16):
        p = Planner(hetero_table).plan(b)
        best_fixed = max(serving(b, k, b * k, b * (k + 1)) for k in range(8))
        assert serving(b, p.k, p.verify_budget, p.tier) >= 0.99 * best_fixed


def test_online_prior_is_the_inflight_curve(hetero_table):
    prior = hetero_table.policy.online.prior
    # hard requests stay longer in the batch: the live first-position rate is below the arrival mean
    assert prior[0] < HETERO.mean_conditional()[0] - 0.05


@pytest.mark.parametrize("b", [1, 4, 16])
def test_online_correction_keeps_stationary_goodput(hetero_table, b):
    from spectune.autotune.simulator import simulate
    from spectune.autotune.tune_pipeline import cost_model

    cost = cost_model(hetero_table)
    kw = dict(concurrency=b, steps=1500, mean_output_tokens=64.0)
    ratios = [simulate(cost, HETERO, Planner(hetero_table), seed=s, **kw).goodput_tok_s
              / simulate(cost, HETERO, TableOnly(hetero_table), seed=s, **kw).goodput_tok_s for s in (11, 12)]
    # at batch 1 the estimate's window holds a handful of requests of a two-class mixture whose
    # rates differ by 0.4-0.9 at every position: the controller moves with them now and then
    assert sum(ratios) / 2 >= (0.97 if b == 1 else 0.99)


def test_online_correction_follows_a_collapse(hetero_table):
    from spectune.autotune.simulator import simulate
    from spectune.autotune.tune_pipeline import cost_model

    cost = cost_model(hetero_table)
    kw = dict(concurrency=16, steps=1500, seed=3, mean_output_tokens=64.0, accept_scale=0.3)
    planner = Planner(hetero_table)
    online = simulate(cost, HETERO, planner, **kw)
    table = simulate(cost, HETERO, TableOnly(hetero_table), **kw)
    assert planner.drift < 0.5 and planner.evidence >= hetero_table.policy.online.min_evidence
    assert min(online.k_hist) < min(table.k_hist)
    assert online.goodput_tok_s > table.goodput_tok_s


def test_online_settings_searched_under_drift(hetero_table, monkeypatch, tmp_path):
    import math

    from spectune.autotune import tune_pipeline as tuner

    kw = dict(scales=(1.0, 0.5), steps=600, seed=5, mean_output_tokens=64.0)
    monkeypatch.setattr(tuner, "ONLINE_GRID", {"window": (256.0, 64.0), "margin": (0.01, 0.05), "min_evidence": (8.0, 32.0)})
    picked = tuner.search_online(hetero_table, HETERO, [4, 16], **kw)
    assert set(picked.ratios) == {(s, b) for s in (1.0, 0.5) for b in (4, 16)}
    assert picked.stationary >= tuner.STATIONARY_FLOOR and picked.evaluated == 8
    monkeypatch.setattr(tuner, "ONLINE_GRID", {"window": (256.0,), "margin": (0.01,), "min_evidence": (8.0,)})
    current = tuner.search_online(hetero_table, HETERO, [4, 16], **kw)
    assert current.evaluated == 1

    def score(r):
        return sum(math.log(v) for v in r.ratios.values())

    assert score(picked) >= score(current) - 1e-12
    with pytest.raises(SpectuneError, match="scales"):
        tuner.search_online(hetero_table, HETERO, [4], scales=(0.5,))


def test_tune_stores_searched_online_settings(tmp_path, monkeypatch):
    from spectune.autotune import tune_pipeline as tuner

    monkeypatch.setattr(tuner, "ONLINE_GRID", {"window": (4096.0, 512.0), "margin": (0.01,), "min_evidence": (64.0,)})
    res = tuner.tune(_profile(SMALL, 8, 7), HETERO, trials=2, online=True)
    assert res.online is not None
    on = res.table.policy.online
    assert (on.window, on.margin, on.min_evidence) == (res.online.window, res.online.margin, res.online.min_evidence)
    assert res.online.evaluated == 3  # the table's own settings first, then the grid
    write_table(res.table, tmp_path / "p.yaml")
    assert read_table(tmp_path / "p.yaml").policy.online == res.table.policy.online
