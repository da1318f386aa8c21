"""Feed exports to the engines' own code; run as a subprocess with the engine on PYTHONPATH.

stdin: JSON list of {"fmt", "config", "max_batch", "graphs"}; stdout: JSON list, per item the K
the engine runs at batch sizes 1..max_batch, or {"error": "..."} when the engine refuses it."""

import json
import sys
import tempfile
import warnings


def vllm_k(item):
    from vllm.config.speculative import SpeculativeConfig
    from vllm.v1.spec_decode.dynamic.utils import (
        build_dynamic_sd_schedule_lookup,
        validate_and_normalize_dynamic_sd_schedule,
    )

    cfg = item["config"]
    if cfg.get("model") is None:
        # the whole config as vLLM's server builds it from --speculative-config
        spec = SpeculativeConfig(**cfg)
        schedule, max_k = spec.num_speculative_tokens_per_batch_size, spec.num_speculative_tokens
    else:
        # a drafter checkpoint needs its config.json and vLLM's CUDA extension to inspect: check
        # the schedule with vLLM's schedule functions
        schedule, max_k = cfg["num_speculative_tokens_per_batch_size"], cfg["num_speculative_tokens"]
        validate_and_normalize_dynamic_sd_schedule(schedule)
    dense = build_dynamic_sd_schedule_lookup([list(e) for e in schedule], item["max_batch"], max_k)
    return dense[1:]


def sglang_k(item):
    from sglang.srt.speculative.adaptive_spec_params import (
        AdaptiveSpeculativeParams,
        resolve_candidate_steps_from_config,
    )

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(item["config"], fh)
    steps = int(item["num_steps"])
    if steps not in resolve_candidate_steps_from_config(fh.name):
        return {"error": f"--speculative-num-steps {steps} is not a candidate"}
    params = AdaptiveSpeculativeParams(initial_steps=steps, cfg_path=fh.name)
    params.set_cuda_graph_bs(item["graphs"])
    return [params.get_steps_for_batch(b) for b in range(1, item["max_batch"] + 1)]


def vllm_scrapes(item):
    # vLLM's own counters: SpecDecodingStats.observe_draft per request-step, SpecDecodingProm.observe
    # per engine step, exposition by prometheus_client; one scrape before and after each phase
    from types import SimpleNamespace

    import numpy as np
    import prometheus_client
    from vllm.v1.spec_decode.metrics import SpecDecodingProm, SpecDecodingStats

    for collector in list(prometheus_client.REGISTRY._collector_to_names):  # one server per item
        prometheus_client.REGISTRY.unregister(collector)
    rates = np.array(item["rates"])
    max_k = len(rates)
    prom = SpecDecodingProm(SimpleNamespace(num_speculative_tokens=max_k), ["model_name", "engine"], {0: ["m", "0"]})
    rng = np.random.default_rng(item["seed"])
    scrapes = [prometheus_client.generate_latest().decode()]
    for ks in item["phases"]:
        for step in range(item["steps"]):
            k = ks[step % len(ks)]
            stats = SpecDecodingStats.new(max_k)
            for _ in range(item["batch"]):
                ok = rng.random(k) < rates[:k]
                stats.observe_draft(k, int(np.argmin(ok)) if not ok.all() else k)
            prom.observe(stats)
        scrapes.append(prometheus_client.generate_latest().decode())
    return scrapes


def main():
    warnings.simplefilter("ignore")
    out = []
    for item in json.load(sys.stdin):
        try:
            run = {"vllm": vllm_k, "sglang": sglang_k, "vllm-metrics": vllm_scrapes}[item["fmt"]]
            out.append(run(item))
        except ModuleNotFoundError as exc:  # the install lacks a module the engine imports
            sys.stdout.write(json.dumps({"missing": exc.name}))
            return
        except Exception as exc:  # the engine's refusal is the answer
            out.append({"error": f"{type(exc).__name__}: {exc}"})
    sys.stdout.write(json.dumps(out))


if __name__ == "__main__":
    main()
