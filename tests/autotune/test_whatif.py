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
