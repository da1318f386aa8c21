from dataclasses import replace

from spectune.autotune.acceptance import resolve_acceptance
from spectune.autotune.whatif import WhatIf, predict_arm, simulate_table, tuned_prior
from spectune.runtime.planner import load
from tests.engine.test_engine import write_policy

HIGH, LOW = "curve:0.9,0.81,0.73", "curve:0.3,0.09,0.03"


def _what(path, shared, made):
    def make():
        made.append(1)
        return load(path, on_gpu_mismatch="ignore")

    return WhatIf(make, resolve_acceptance(HIGH, 3), resolve_acceptance(LOW, 3), requests=lambda c: 12,
                  repeats=3, decode_tokens=15, shared=shared)


def test_shared_planner_is_trained_once_and_serves_every_seed(tmp_path):
    # the bench's protocol: one planner, trained by an untimed run of the first seed, then every
    # timed run continues from the state the previous one left
    path = write_policy(tmp_path / "p.yaml")
    made: list[int] = []
    what = _what(path, True, made)
    rows = simulate_table(what, [4], ["auto"])["rows"]
    assert len(made) == 2  # the table, then the one planner of every auto run
    planner = load(path, on_gpu_mismatch="ignore")
    work = dict(concurrency=4, requests=12, decode_tokens=15, context_len=planner.cost.context_len,
                drift=what.drift, prior=tuned_prior(planner.table))
    predict_arm(planner.cost, what.acceptance, lambda: planner, seeds=[0], **work)
    want = predict_arm(planner.cost, what.acceptance, lambda: planner, seeds=range(3), **work)
    assert rows[0]["full_tok_s"] == want.full_tok_s and rows[0]["goodput_tok_s"] == want.goodput_tok_s
    fresh = simulate_table(_what(path, False, made), [4], ["auto"])["rows"]
    assert fresh[0]["goodput_tok_s"] != rows[0]["goodput_tok_s"]  # the protocol changes the answer


def test_served_cost_off_the_table_is_recovered_by_measured_step_times():
    """The shipped qwen3-8b table served where its drafter costs more than the profile says (a GPU
    whose step times the table's cost model does not know), on MT-Bench n-gram traffic it was not
    tuned on, at batch 16 under the bench's protocol, judged on the served cost against every
    fixed K 1..7 and plain. At 1.4x auto with the steps' measured times is within 0.98 of the
    best arm (the model alone is too: 0.996, its in-block change test and online K cover it). At
    2.5x the model alone ranks the shapes wrong (0.936 of the best arm) and the measured times
    recover most of it (0.975)."""
    import dataclasses
    import importlib.resources

    from spectune.autotune.whatif import heldout_sources

    path = importlib.resources.files("spectune").joinpath(
        "profiles", "nvidia-h200_qwen3-8b_eagle-1l.ctx320.policy.yaml")
    table_cost = load(str(path), on_gpu_mismatch="ignore").cost
    acceptance = resolve_acceptance(heldout_sources()["mtbench-ngram"][0], 15)

    def ratio(time_feedback: bool, factor: float) -> float:
        served = dataclasses.replace(table_cost, params=table_cost.params.scaled(drafter=factor))

        def make():
            p = load(str(path), on_gpu_mismatch="ignore")
            p.online = dataclasses.replace(p.online, time_feedback=time_feedback)
            return p

        what = WhatIf(make, acceptance, requests=lambda c: 48, repeats=5, decode_tokens=63, shared=True,
                      served_cost=served)
        rows = simulate_table(what, [16], [*(f"fixed:{k}" for k in range(1, 8)), "plain", "auto"])["rows"]
        return next(r["full_ratio_vs_best_other"] for r in rows if r["arm"] == "auto")

    assert ratio(True, 1.4) >= 0.98
    on, off = ratio(True, 2.5), ratio(False, 2.5)
    assert on > off + 0.02, (on, off)


def test_a_fixed_arm_is_the_best_k_scans_own_run_and_is_not_run_again(tmp_path, monkeypatch):
    import spectune.autotune.whatif as whatif

    path = write_policy(tmp_path / "p.yaml")
    what = _what(path, False, [])
    calls = []
    real = whatif.predict_arm
    monkeypatch.setattr(whatif, "predict_arm", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    rows = simulate_table(what, [4], ["plain", "fixed:1", "fixed:2", "fixed:3", "auto"])["rows"]
    assert len(calls) == 3 + 2  # the scan of K 1..3, then plain and auto: no fixed arm twice
    planner = load(path, on_gpu_mismatch="ignore")
    work = dict(concurrency=4, requests=12, decode_tokens=15, context_len=planner.cost.context_len,
                drift=what.drift, prior=tuned_prior(planner.table), seeds=range(3))
    for k in (1, 2, 3):  # each row as its own run would give it
        want = real(planner.cost, what.acceptance, lambda k=k: whatif.FixedK(k), **work)
        row = next(r for r in rows if r["arm"] == f"fixed:{k}")
        assert (row["goodput_tok_s"], row["full_tok_s"], row["k_hist"]) == (
            want.goodput_tok_s, want.full_tok_s, {str(k): n for k, n in want.k_hist.items()})
    calls.clear()
    simulate_table(replace(what, host_lag=True), [4], ["fixed:1"])  # arms that run otherwise: run
    assert len(calls) == 3 + 1 and calls[-1]["host_lag"] is True


def test_plain_retried_against_k1_on_mtbench_ngram_at_batch_64():
    """The H100 table's standing miss, under the bench's protocol over 512 requests: MT-Bench n-gram
    at c = 64, where plain leads K = 1 by 2 %. A change fires on a run of well-accepted requests,
    the table's K goes back to K = 1, and plain's one trial against it is judged on an estimate
    of those same requests; plain is now tried again (where it leads by the point estimate, half
    a window after the last try). Read 0.991 x plain before (0.981 on an H100 over 512 requests),
    0.997 with it, 0.996 since the in-block change test runs where first drafts double (3 seeds)."""
    import importlib.resources

    from spectune.autotune.whatif import heldout_sources

    path = str(importlib.resources.files("spectune").joinpath(
        "profiles", "nvidia-h100_qwen3-8b_eagle-1l.fused.ctx320.policy.yaml"))
    acceptance = resolve_acceptance(heldout_sources()["mtbench-ngram"][0], 15)
    what = WhatIf(lambda: load(path, on_gpu_mismatch="ignore"), acceptance, requests=lambda c: 512, repeats=3,
                  decode_tokens=63, shared=True, host_lag=True)
    rows = {r["arm"]: r for r in simulate_table(what, [64], ["plain", "fixed:1", "auto"])["rows"]}
    plain = rows["plain"]["full_tok_s"]
    assert rows["fixed:1"]["full_tok_s"] < 0.985 * plain  # the cell: plain leads
    assert rows["auto"]["full_tok_s"] > 0.994 * plain, rows["auto"]["k_hist"]
    assert rows["auto"]["k_hist"].get("0", 0) > 0.4 * sum(rows["auto"]["k_hist"].values())
