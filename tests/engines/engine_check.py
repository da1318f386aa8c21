"""Feed exports to the engines' own code; run as a subprocess with the engine on PYTHONPATH.

stdin: JSON list of items ({"fmt": "vllm", "flags", "target"}, {"fmt": "sglang", "config",
"max_batch", "graphs", "num_steps"}, ...); written to the file named by argv[1] (the engines log to
stdout): JSON list, per item the engine's answer, or {"error": "..."} when the engine refuses it."""

import json
import sys
import tempfile
import warnings


def vllm_k(item):
    # the exported server flags as `vllm serve` parses them (its own argument parser and checks),
    # then the engine config it builds before starting (EngineArgs.create_engine_config: target and
    # drafter ModelConfig from their config.json, SpeculativeConfig, scheduler), then the schedule
    # lookup its scheduler builds (vllm/v1/core/sched/scheduler.py) from that config
    import vllm
    from vllm.entrypoints.common.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(
        ["--model", item["target"], *item["flags"]]
    )
    validate_parsed_serve_args(args)
    config = vllm.AsyncEngineArgs.from_cli_args(args).create_engine_config(
        usage_context=UsageContext.OPENAI_API_SERVER
    )
    spec = config.speculative_config
    dense = build_dynamic_sd_schedule_lookup(
        spec.num_speculative_tokens_per_batch_size,
        vllm_max_batch_size=config.scheduler_config.max_num_seqs,
        vllm_num_speculative_tokens=spec.num_speculative_tokens,
    )
    drafter = spec.draft_model_config.architectures if spec.draft_model_config is not None else None
    return {
        "k": dense[1:],
        "method": spec.method,
        "drafter": drafter,
        "max_num_seqs": config.scheduler_config.max_num_seqs,
    }


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
    prom = SpecDecodingProm(
        SimpleNamespace(num_speculative_tokens=max_k), ["model_name", "engine"], {0: ["m", "0"]}
    )
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
    result = sys.argv[1]
    out = []
    for item in json.load(sys.stdin):
        try:
            run = {"vllm": vllm_k, "sglang": sglang_k, "vllm-metrics": vllm_scrapes}[item["fmt"]]
            out.append(run(item))
        except ModuleNotFoundError as exc:  # the install lacks a module the engine imports
            with open(result, "w") as fh:
                json.dump({"missing": exc.name}, fh)
            return
        except (
            SystemExit
        ) as exc:  # vllm serve's argument parser refused the flags (message on stderr)
            out.append({"error": f"argument parser exited {exc.code}"})
        except Exception as exc:  # the engine's refusal is the answer
            out.append({"error": f"{type(exc).__name__}: {exc}"})
    with open(result, "w") as fh:
        json.dump(out, fh)


if __name__ == "__main__":
    main()
