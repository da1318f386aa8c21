"""SGLang's and TensorRT-LLM's acceptance metrics (spectune/autotune/acceptance_engines.py), written
in the engines' own field names from simulated serving with a known per-position curve: exact
within 5 % per position where every K was run, refused in one line otherwise."""

import json
import re

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from spectune.autotune.acceptance import AcceptanceError, load_acceptance
from spectune.cli import main

RATES = np.array([0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6])  # conditional, per position
TRUE = np.cumprod(RATES)
PROFILE = "spectune/profiles/nvidia-h200_qwen3-8b_eagle-1l.yaml"


def _accepted(rng, n, k):
    # [n] accepted drafts of n request-steps at draft length k: the first rejection stops the chain
    ok = rng.random((n, k)) < RATES[:k]
    return np.where(ok.all(axis=1), k, np.argmin(ok, axis=1))


def _trtllm_iterations(rng, plan):
    """plan: [(K, iterations, batch)]. One dict per iteration as trtllm-serve's /metrics lists them."""
    out, it = [], 0
    for k, iters, batch in plan:
        for _ in range(iters):
            a = int(_accepted(rng, batch, k).sum())
            spec = {
                "numDraftTokens": batch * k,
                "numAcceptedTokens": a,
                "numRequestsWithDraftTokens": batch,
                "acceptanceLength": (a + batch) / batch,
                "iterLatencyMS": 1.5,
                "draftOverhead": 0.2,
            }
            out.append(
                {
                    "iter": it,
                    "iterLatencyMS": 12.0,
                    "numActiveRequests": batch,
                    "specDecodingStats": spec,
                }
            )
            it += 1
    return out


def _write(path, obj):
    path.write_text(json.dumps(obj))
    return str(path)


def test_trtllm_iteration_stats_give_the_curve_when_every_k_ran(tmp_path):
    rng = np.random.default_rng(0)
    # a draft_len_schedule: K 7 at small batches down to K 1 at large ones; two /metrics responses
    stats = _trtllm_iterations(rng, [(k, 8000, 256) for k in range(7, 0, -1)])
    files = [
        _write(tmp_path / "m0.json", stats[: len(stats) // 2]),
        _write(tmp_path / "m1.json", stats[len(stats) // 2 :]),
    ]
    model = load_acceptance("trtllm-stats:" + ",".join(files), max_k=7)
    got = np.array(model.mean_survival(7))
    assert np.all(np.abs(got / TRUE - 1) < 0.05), got
    assert "K 1/2/3/4/5/6/7" in model.source


def test_trtllm_refusals_are_one_line(tmp_path):
    rng = np.random.default_rng(1)
    only7 = _write(tmp_path / "k7.json", _trtllm_iterations(rng, [(7, 50, 8)]))
    with pytest.raises(AcceptanceError, match=r"missing 1-6"):
        load_acceptance(f"trtllm-stats:{only7}", max_k=7)
    gap = _write(tmp_path / "gap.json", _trtllm_iterations(rng, [(1, 20, 8), (3, 20, 8)]))
    with pytest.raises(AcceptanceError, match=r"missing 2\)"):
        load_acceptance(f"trtllm-stats:{gap}", max_k=7)
    mixed = _trtllm_iterations(rng, [(2, 3, 8)])
    mixed[1]["specDecodingStats"].update(
        numDraftTokens=13, numAcceptedTokens=5
    )  # 13 drafts over 8 requests
    with pytest.raises(AcceptanceError, match="iteration 1: 13 draft tokens over 8 requests"):
        load_acceptance("trtllm-stats:" + _write(tmp_path / "mixed.json", mixed), max_k=7)
    plain = [{"iter": 0, "iterLatencyMS": 10.0, "numActiveRequests": 4}]
    with pytest.raises(AcceptanceError, match="no specDecodingStats"):
        load_acceptance("trtllm-stats:" + _write(tmp_path / "plain.json", plain), max_k=7)
    bad = _trtllm_iterations(rng, [(1, 2, 4)])
    bad[0]["specDecodingStats"]["numAcceptedTokens"] = -3
    with pytest.raises(AcceptanceError, match="numAcceptedTokens must be a count"):
        load_acceptance("trtllm-stats:" + _write(tmp_path / "bad.json", bad), max_k=7)
    (tmp_path / "torn.jsonl").write_text('{"iter": 0}\n{"iter": 1, "specDec')
    with pytest.raises(AcceptanceError, match="torn.jsonl:2: not JSON"):
        load_acceptance(f"trtllm-stats:{tmp_path / 'torn.jsonl'}", max_k=7)


def test_cli_tune_on_trtllm_stats_writes_or_refuses(tmp_path, capsys):
    rng = np.random.default_rng(2)
    good = _write(tmp_path / "good.json", _trtllm_iterations(rng, [(k, 40, 16) for k in (1, 2, 3)]))
    out = tmp_path / "policy.yaml"
    assert (
        main(
            [
                "tune",
                PROFILE,
                "--acceptance",
                f"trtllm-stats:{good}",
                "--out",
                str(out),
                "--trials",
                "2",
            ]
        )
        == 0
    )
    assert out.exists()
    capsys.readouterr()
    only = _write(tmp_path / "only.json", _trtllm_iterations(rng, [(4, 40, 16)]))
    refused = tmp_path / "refused.yaml"
    assert (
        main(
            [
                "tune",
                PROFILE,
                "--acceptance",
                f"trtllm-stats:{only}",
                "--out",
                str(refused),
                "--trials",
                "2",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "only.json" in err and "missing 1-3" in err
    assert not refused.exists()


def _sglang_scrapes(rng, plan, *, window_batches=40, draft_tokens=None):
    """plan: [(K, windows, batch)]: one scrape after each decode-log window, the gauges as SGLang's
    SchedulerMetricsCollector sets them (accepted drafts + bonus per request-step; active steps)."""
    registry = CollectorRegistry()
    labels = {
        "model_name": "m",
        "engine_type": "unified",
        "tp_rank": "0",
        "pp_rank": "0",
        "dp_rank": "0",
    }
    gauges = {
        name: Gauge(name, name, labelnames=list(labels), registry=registry)
        for name in (
            "sglang:spec_accept_length",
            "sglang:spec_num_steps",
            "sglang:spec_num_draft_tokens",
        )
    }
    scrapes = []
    for k, windows, batch in plan:
        for _ in range(windows):
            a = _accepted(rng, window_batches * batch, k)
            gauges["sglang:spec_accept_length"].labels(**labels).set(1.0 + a.mean())
            gauges["sglang:spec_num_steps"].labels(**labels).set(k)
            gauges["sglang:spec_num_draft_tokens"].labels(**labels).set(draft_tokens or k + 1)
            scrapes.append(generate_latest(registry).decode())
    return scrapes


def _write_scrapes(tmp_path, scrapes, stem="s"):
    paths = []
    for i, text in enumerate(scrapes):
        p = tmp_path / f"{stem}{i}.prom"
        p.write_text(text)
        paths.append(str(p))
    return "sglang-metrics:" + ",".join(paths)


def test_sglang_gauges_give_the_curve_when_every_k_ran(tmp_path):
    rng = np.random.default_rng(3)
    # adaptive tiers: K 5 down to 1 as the batch grows; the first window after each switch is left out
    scrapes = _sglang_scrapes(rng, [(k, 100, 256) for k in range(5, 0, -1)])
    scrapes.insert(
        50, scrapes[49]
    )  # a scrape before the next log: the same window twice, counted once
    model = load_acceptance(_write_scrapes(tmp_path, scrapes), max_k=5)
    got = np.array(model.mean_survival(5))
    assert np.all(np.abs(got / TRUE[:5] - 1) < 0.05), got
    # 499 windows after the first scrape, 4 of them across a switch; a window whose gauges equal the
    # one before (the duplicate, or by chance) is read as the same window
    windows = int(
        re.search(r"(\d+) windows at K 1/2/3/4/5, 4 left out: K changed", model.source).group(1)
    )
    assert 490 <= windows <= 494


def test_sglang_refusals_are_one_line(tmp_path):
    rng = np.random.default_rng(4)
    fixed = _sglang_scrapes(rng, [(3, 5, 8)])
    with pytest.raises(AcceptanceError, match="missing 1-2"):
        load_acceptance(_write_scrapes(tmp_path, fixed, "fixed"), max_k=7)
    with pytest.raises(AcceptanceError, match="one scrape"):
        load_acceptance(_write_scrapes(tmp_path, fixed[:1], "one"), max_k=7)
    tree = _sglang_scrapes(rng, [(1, 3, 8)], draft_tokens=8)
    with pytest.raises(AcceptanceError, match="tree drafts"):
        load_acceptance(_write_scrapes(tmp_path, tree, "tree"), max_k=7)
    nosteps = [
        t.replace("sglang:spec_num_steps", "sglang:other_gauge")
        for t in _sglang_scrapes(rng, [(1, 3, 8)])
    ]
    with pytest.raises(AcceptanceError, match="the K of the window is not known"):
        load_acceptance(_write_scrapes(tmp_path, nosteps, "nosteps"), max_k=7)
    (tmp_path / "vllm.prom").write_text(
        "# TYPE vllm:spec_decode_num_drafts counter\nvllm:spec_decode_num_drafts_total 3\n"
    )
    with pytest.raises(AcceptanceError, match="no sglang:spec_accept_length"):
        load_acceptance(
            f"sglang-metrics:{tmp_path / 'vllm.prom'},{tmp_path / 'vllm.prom'}", max_k=7
        )
