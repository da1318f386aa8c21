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


def main():
    warnings.simplefilter("ignore")
    out = []
    for item in json.load(sys.stdin):
        try:
            out.append(vllm_k(item) if item["fmt"] == "vllm" else sglang_k(item))
        except Exception as exc:  # the engine's refusal is the answer
            out.append({"error": f"{type(exc).__name__}: {exc}"})
    sys.stdout.write(json.dumps(out))


if __name__ == "__main__":
    main()
