"""vLLM metrics while K varies: scrapes produced with vLLM's own counter semantics
(vllm/v1/spec_decode/metrics.py: SpecDecodingStats.observe_draft, SpecDecodingProm), read as a
series of per-interval deltas: the true curve where the intervals determine the offered counts,
one refusing line where they do not."""

import http.server
import threading

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

from spectune.autotune.acceptance import AcceptanceError, load_acceptance
from spectune.autotune.acceptance_sources import metrics_model, poll_scrapes
from spectune.cli import main

RATES = np.array([0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6])  # true conditional acceptance per position
TRUE = np.cumprod(RATES)  # survival s_1..s_7
MAX_K = 7


class VllmServer:
    """vLLM's spec-decode counters, one engine, per-position labels up to num_speculative_tokens."""

    def __init__(self, seed=0):
        self.rng = np.random.default_rng(seed)
        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        mk = lambda name, doc, extra=(): Counter(name, doc, labels + list(extra), registry=self.registry)  # noqa: E731
        self.drafts = mk("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.").labels("m", "0")
        self.tokens = mk("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.").labels("m", "0")
        self.accepted = mk("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.").labels("m", "0")
        per_pos = mk("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
                     ["position"])
        self.per_pos = [per_pos.labels("m", "0", str(i)) for i in range(MAX_K)]

    def step(self, k, batch=8):
        # one engine step at draft length k: observe_draft(k, accepted) per request
        if k == 0:
            return
        for _ in range(batch):
            ok = self.rng.random(k) < RATES[:k]
            acc = int(np.argmin(ok)) if not ok.all() else k  # accepted prefix
            self.drafts.inc(1)
            self.tokens.inc(k)
            self.accepted.inc(acc)
            for i in range(acc):
                self.per_pos[i].inc(1)

    def scrape(self):
        return generate_latest(self.registry).decode()


def _series(phases, steps):
    srv, texts = VllmServer(), []
    texts.append(("scrape-0", srv.scrape()))
    for j, ks in enumerate(phases):
        for s in range(steps):
            srv.step(ks[s % len(ks)])
        texts.append((f"scrape-{j + 1}", srv.scrape()))
    return texts


def test_one_k_per_interval_gives_the_true_curve():
    # the schedule ran K 7, then 3, then 1 (batch sizes moved between ranges between scrapes)
    texts = _series([[7], [3], [1]], steps=2500)
    m = metrics_model(texts, max_k=MAX_K)
    got = np.array(m.mean_survival(MAX_K))
    assert np.all(np.abs(got / TRUE - 1) < 0.05), got
    assert "3 intervals" in m.source
    # the same counters as one snapshot would read low at every position past 1 (not determined)
    with pytest.raises(AcceptanceError, match="not determined"):
        metrics_model(texts[-1:], max_k=MAX_K)


def test_k_cycling_within_intervals_is_refused_in_one_line():
    texts = _series([[7, 3, 1], [7, 3, 1]], steps=900)
    with pytest.raises(AcceptanceError) as err:
        metrics_model(texts, max_k=MAX_K)
    msg = str(err.value)
    assert "\n" not in msg and "interval 1 of 2" in msg and "averaged 3.67" in msg and "traces" in msg
    # three Ks mixed: naming them does not determine the split either
    with pytest.raises(AcceptanceError, match="not determined"):
        metrics_model(texts, max_k=MAX_K, ks=[7, 3, 1])


def test_two_known_ks_mixed_are_exact():
    texts = _series([[7, 3], [7, 7, 3]], steps=1800)
    got = np.array(metrics_model(texts, max_k=MAX_K, ks=[7, 3]).mean_survival(MAX_K))
    assert np.all(np.abs(got / TRUE - 1) < 0.05), got


def test_series_from_files_and_a_restart(tmp_path):
    texts = _series([[7], [3]], steps=800)
    files = []
    for j, (_, text) in enumerate(texts):
        f = tmp_path / f"s{j}.prom"
        f.write_text(text)
        files.append(str(f))
    m = load_acceptance("metrics:" + ",".join(files), max_k=MAX_K)
    assert np.all(np.abs(np.array(m.mean_survival(MAX_K)) / TRUE - 1) < 0.05)
    with pytest.raises(AcceptanceError, match="went down since scrape 2"):
        load_acceptance("metrics:" + ",".join([files[0], files[2], files[1]]), max_k=MAX_K)


def _serve(texts):
    served = iter(texts)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = next(served)[1].encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_poll_a_url():
    texts = _series([[7], [3]], steps=600)
    server = _serve(texts)
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        waits = []
        got = poll_scrapes(url, every_s=30, for_s=60, sleep=waits.append)
        assert waits == [30, 30] and len(got) == 3
        m = metrics_model(got, max_k=MAX_K)
        assert np.all(np.abs(np.array(m.mean_survival(MAX_K)) / TRUE - 1) < 0.05)
    finally:
        server.shutdown()


def test_cli_tune_refuses_a_mixed_scrape_in_one_line(tmp_path, capsys):
    texts = _series([[7, 3, 1]], steps=300)
    f = tmp_path / "mixed.prom"
    f.write_text(texts[-1][1])
    out = tmp_path / "policy.yaml"
    profile = "tests/autotune/data/policy_small.yaml"
    assert main(["tune", profile, "--acceptance", f"metrics:{f}", "--out", str(out), "--trials", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not determined" in err
    assert not out.exists()


def test_cli_tune_polls_a_url(tmp_path, capsys):
    texts = _series([[7], [3], [1]], steps=300)
    server = _serve(texts)
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        out = tmp_path / "policy.yaml"
        profile = "tests/autotune/data/policy_small.yaml"
        assert main(["tune", profile, "--acceptance", url, "--scrape-every", "0.01", "--scrape-for", "0.03",
                     "--out", str(out), "--trials", "1"]) == 0
        assert "vllm-metrics" in capsys.readouterr().out and out.exists()
    finally:
        server.shutdown()
    assert main(["tune", profile, "--acceptance", "curve:0.8", "--scrape-every", "1", "--scrape-for", "2",
                 "--out", str(out)]) == 2


@pytest.mark.parametrize("every, for_s, bad", [("-1", "2", "--scrape-every"), ("1", "0", "--scrape-for")])
def test_cli_scrape_times_must_be_positive_before_anything_is_polled(tmp_path, capsys, every, for_s, bad):
    out = tmp_path / "policy.yaml"
    assert main(["tune", "tests/autotune/data/policy_small.yaml", "--acceptance", "http://127.0.0.1:9/metrics",
                 "--scrape-every", every, "--scrape-for", for_s, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{bad}: must be > 0 seconds" in err and "scraping" not in err
    assert not out.exists()
