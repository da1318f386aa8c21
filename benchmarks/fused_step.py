"""The target decode step unfused vs fused (kernels/fused.py), beside a torch.compile'd decoder.

One random-weight target (default qwen3-8b, bf16, built as the profiler builds it:
``models.build.build_target`` and ``target_step``, paged Triton attention over ``--context-len``
tokens of KV per request) is timed at q = 1 for each batch size with the profiler's timer
(``autotune.timing.default_timer``: a FULL CUDA graph of the step, median of replays):

  unfused   the reference decoder as the shipped profiles measured it
  fused     the same weights with ``model.fused = True`` and ``model.kv_write = False``: residual
            + RMSNorm, q/k-norm + RoPE and SiLU x mul one kernel each, the paged KV-cache write
            a kernel of its own (``kernels.kv_cache.write_kv``)
  fused_kv  ``model.kv_write = True`` (the default of ``fused``): the KV-cache write inside
            the q/k-norm + RoPE kernel (``kernels.fused.qk_norm_rope_write``), one launch less per
            layer (only with paged Triton attention: ``--attention torch`` makes it ``fused``)
  fused_small_m  ``fused_kv`` with ``model.small_m`` (the decoder's default): a one-row
            forward (batch 1) runs its projections and the lm_head through the one-row Triton
            kernel (``kernels.gemv.gemv_row``); more rows are F.linear, as in ``fused_kv``
  fused_lt  ``fused_small_m`` with ``model.lt_rows``: projections at 17..64 rows under cuBLASLt
            (``kernels.gemv.rows_linear``) instead of torch's default cuBLAS
  compiled  the yardstick: a decoder of this script's own over the same weights, one layer
            function ``torch.compile``'d (static shapes, one graph per batch size, reused by every
            layer), folded-GQA SDPA over a dense static KV of context + 1 slots per request, the
            new K/V written into the last slot; the step around it captured the same way

Beside each time, the device kernels one eager step launches (torch.profiler, CUDA only). Before
timing, both fused steps' logits are checked against the unfused step's on the same inputs, and
fused_kv's against fused's (the same maths, the cache write moved: equal bit for bit).
Prints a table; writes ``fused_step.json`` under ``--out-dir`` (default $OUT, else
benchmarks/results/).

    python benchmarks/fused_step.py                     # one H200: ~2 minutes (3 compiles)
    python benchmarks/fused_step.py --device cpu --preset tiny --batches 1,2 --context-len 32 \\
        --compile-backend eager --attention triton      # dry run of every code path
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

if not torch.cuda.is_available():  # the CPU dry run runs the fused kernels in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402

from spectune.autotune.hardware import software_facts  # noqa: E402
from spectune.autotune.timing import Timer, default_timer, free_device_memory  # noqa: E402
from spectune.io import atomic_write_text  # noqa: E402
from spectune.kernels.fused import apply_rope  # noqa: E402
from spectune.kernels.gemv import LT_ROWS  # noqa: E402
from spectune.models.build import AttentionChoice, StepFn, build_target, target_step  # noqa: E402
from spectune.models.config import ModelArgs, ModelError, resolve_target  # noqa: E402
from spectune.models.decoder import Transformer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_common import first_line, int_list, say  # noqa: E402  (the probes' shared helpers)


def count_kernels(run: Callable[[], object], device: torch.device) -> int | None:
    """Device kernels (and memcpy/memset) one eager ``run()`` launches; None off CUDA."""
    if device.type != "cuda":
        return None
    run()  # lazy inits and compiles outside the count
    torch.cuda.synchronize(device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize(device)
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


# ---------------------------------------------------------------------------------------------
# the compiled yardstick


def reference_layer(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    w: dict[str, torch.Tensor],
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    eps: float,
) -> torch.Tensor:
    """One decoder layer at q = 1: x [B, dim] -> [B, dim]; k_cache, v_cache [B, Hkv, S, D], the
    new K/V written into slot S - 1, every slot visible."""
    b = x.shape[0]
    g = n_heads // n_kv_heads
    h = F.rms_norm(x, (x.shape[-1],), w["attn_norm"], eps)
    hq, hkv = n_heads * head_dim, n_kv_heads * head_dim
    q, k, v = F.linear(h, w["wqkv"]).split([hq, hkv, hkv], dim=-1)
    q, k = q.view(b, n_heads, head_dim), k.view(b, n_kv_heads, head_dim)
    if "q_norm" in w:
        q = F.rms_norm(q, (head_dim,), w["q_norm"], eps)
        k = F.rms_norm(k, (head_dim,), w["k_norm"], eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k_cache.select(2, -1).copy_(k)
    v_cache.select(2, -1).copy_(v.reshape(b, n_kv_heads, head_dim))
    # folded GQA: the G query heads of a KV head are G query rows over that head's KV
    o = F.scaled_dot_product_attention(q.view(b, n_kv_heads, g, head_dim), k_cache, v_cache)
    x = x + F.linear(o.reshape(b, hq), w["wo"])
    gate, up = F.linear(F.rms_norm(x, (x.shape[-1],), w["mlp_norm"], eps), w["w13"]).chunk(
        2, dim=-1
    )
    return x + F.linear(F.silu(gate) * up, w["w2"])


def layer_weights(model: Transformer) -> list[dict[str, torch.Tensor]]:
    out = []
    for layer in model.layers:
        w = {
            "attn_norm": layer.attn_norm.weight,
            "wqkv": layer.attn.wqkv,
            "wo": layer.attn.wo,
            "mlp_norm": layer.mlp_norm.weight,
            "w13": layer.mlp.w13,
            "w2": layer.mlp.w2,
        }
        if layer.attn.q_norm is not None:
            w["q_norm"], w["k_norm"] = layer.attn.q_norm.weight, layer.attn.k_norm.weight
        out.append({k: v.data if isinstance(v, torch.nn.Parameter) else v for k, v in w.items()})
    return out


def compiled_step(
    model: Transformer, layer_fn: Callable[..., torch.Tensor], batch: int, context: int
) -> StepFn:
    """The yardstick's step on static buffers: embedding, the compiled layers, norm, lm_head."""
    args, device, dtype = model.args, model.device, model.dtype
    weights = layer_weights(model)
    shape = (batch, args.n_kv_heads, context + 1, args.head_dim)
    caches = [
        (
            torch.randn(shape, device=device, dtype=dtype),
            torch.randn(shape, device=device, dtype=dtype),
        )
        for _ in weights
    ]  # [B, Hkv, S, D] per layer, non-zero
    ids = torch.empty(batch, dtype=torch.long, device=device)
    cos, sin = model.rotary(
        torch.full((batch,), context, dtype=torch.long, device=device), dtype
    )  # [B, 1, D]

    def refresh() -> None:
        ids.random_(1, args.vocab_size)

    def run() -> object:
        x = F.embedding(ids, model.embed)
        for w, (kc, vc) in zip(weights, caches, strict=True):
            x = layer_fn(
                x,
                cos,
                sin,
                w,
                kc,
                vc,
                n_heads=args.n_heads,
                n_kv_heads=args.n_kv_heads,
                head_dim=args.head_dim,
                eps=args.rms_eps,
            )
        return F.linear(model.norm(x), model.head_weight)

    refresh()
    return StepFn(run=run, refresh=refresh, tokens=batch, batch=batch, label=f"compiled b={batch}")


# ---------------------------------------------------------------------------------------------
# points


ARMS = ("unfused", "fused", "fused_kv", "fused_small_m", "fused_lt")  # the decoder's own arms, beside "compiled"


def set_arm(model: Transformer, arm: str) -> None:
    model.fused = arm != "unfused"
    model.kv_write = arm in ("fused_kv", "fused_small_m", "fused_lt")
    model.small_m = arm in ("fused_small_m", "fused_lt")
    model.lt_rows = arm == "fused_lt"


def check_fused(
    model: Transformer, batch: int, context: int, attention: AttentionChoice = "auto"
) -> dict[str, Any]:
    """Each arm's logits of the same step on the same inputs (fresh caches each): each fused arm
    against unfused, and fused_kv against fused (expected equal bit for bit)."""
    logits = {}
    for arm in ARMS:
        set_arm(model, arm)
        torch.manual_seed(1)  # the same random KV cache for every arm
        step = target_step(
            model,
            batch=batch,
            q=1,
            context_len=context,
            generator=torch.Generator(device=model.device).manual_seed(1),
            attention=attention,
        )
        logits[arm] = step.run().float()  # type: ignore[attr-defined]
        model.backend = None
    set_arm(model, "unfused")
    ref = logits["unfused"]
    out: dict[str, Any] = {"batch": batch, "ref_abs_max": float(ref.abs().max())}
    for arm in ARMS[1:]:
        got = logits[arm]
        out[arm] = {
            "max_abs_diff": float((got - ref).abs().max()),
            "argmax_agree": float((got.argmax(-1) == ref.argmax(-1)).float().mean()),
        }
    out["fused_kv_equals_fused"] = bool(torch.equal(logits["fused_kv"], logits["fused"]))
    got, kv = logits["fused_small_m"], logits["fused_kv"]  # another fp32 sum order: close, not equal
    out["fused_small_m_vs_fused_kv"] = {
        "max_abs_diff": float((got - kv).abs().max()),
        "argmax_agree": float((got.argmax(-1) == kv.argmax(-1)).float().mean()),
    }
    return out


def time_point(step: StepFn, timer: Timer, device: torch.device) -> dict[str, Any]:
    point: dict[str, Any] = {}
    try:
        point["kernels"] = count_kernels(step.run, device)
        t = timer(step)
        point.update(ms=t.median_ms, p20_ms=t.p20_ms, p80_ms=t.p80_ms, reps=t.reps, mode=t.mode)
    except Exception as exc:  # one bad point must not end the run
        point["error"] = first_line(exc)
    return point


def run_arm(
    arm: str,
    model: Transformer,
    batches: list[int],
    context: int,
    timer: Timer,
    layer_fn: Callable[..., torch.Tensor] | None,
    attention: AttentionChoice = "auto",
) -> list[dict[str, Any]]:
    points = []
    for batch in batches:
        point: dict[str, Any] = {"arm": arm, "batch": batch, "q": 1, "context_len": context}
        try:
            start = time.perf_counter()
            if arm == "compiled":
                assert layer_fn is not None
                step = compiled_step(model, layer_fn, batch, context)
                step.run()  # compiles this shape
                point["compile_s"] = time.perf_counter() - start
            else:
                set_arm(model, arm)
                step = target_step(
                    model,
                    batch=batch,
                    q=1,
                    context_len=context,
                    attention=attention,
                )
            point.update(time_point(step, timer, model.device))
            del step
        except Exception as exc:
            point["error"] = first_line(exc)
        set_arm(model, "unfused")
        model.backend = None
        free_device_memory()
        say(
            f"  {arm:>8} b={batch:<4} "
            + (
                f"{point['ms']:.3f} ms, {point.get('kernels')} kernels"
                if "ms" in point
                else point.get("error", "")
            )
        )
        points.append(point)
    return points


def print_table(result: dict[str, Any]) -> None:
    by = {(p["arm"], p["batch"]): p for p in result["points"]}
    say(
        f"\n{result['target']} {result['dtype']} context {result['context_len']}, q = 1, step ms (kernels)"
    )
    arms = (*ARMS, "compiled")
    say(
        f"{'batch':>6} "
        + " ".join(f"{a:>16}" for a in arms)
        + f" {'fused_kv/fused':>15} {'fused_kv/compiled':>18} {'small_m/fused_kv':>17} {'lt/small_m':>11}"
    )
    for b in result["batches"]:
        cells, ms = [], {}
        for arm in arms:
            p = by.get((arm, b), {})
            ms[arm] = p.get("ms")
            cells.append(f"{p['ms']:.3f} ({p.get('kernels')})" if "ms" in p else "-")
        ratios = [
            f"{ms['fused_kv'] / ms[other]:.3f}" if ms["fused_kv"] and ms[other] else "-"
            for other in ("fused", "compiled")
        ]
        sm = ms["fused_small_m"]
        ratios.append(f"{sm / ms['fused_kv']:.3f}" if sm and ms["fused_kv"] else "-")
        ratios.append(f"{ms['fused_lt'] / sm:.3f}" if sm and ms["fused_lt"] else "-")
        say(f"{b:>6} " + " ".join(f"{c:>16}" for c in cells)
            + f" {ratios[0]:>15} {ratios[1]:>18} {ratios[2]:>17} {ratios[3]:>11}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-8b", help="target preset (default qwen3-8b)")
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--context-len", type=int, default=2048)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument(
        "--compile-backend",
        default="inductor",
        help="torch.compile backend of the yardstick (eager: a quick dry run)",
    )
    ap.add_argument("--no-compiled", action="store_true", help="skip the compiled yardstick")
    ap.add_argument(
        "--attention",
        choices=["auto", "triton", "torch"],
        default="auto",
        help="target attention (auto: paged Triton on CUDA, dense torch elsewhere; the fused_kv "
        "arm needs triton: on CPU that is Triton's interpreter)",
    )
    ap.add_argument("--out-dir", default=os.environ.get("OUT") or "benchmarks/results")
    args = ap.parse_args(argv)
    batches = int_list(args.batches, "--batches", example="1,32,128")
    if args.context_len < 1:
        raise SystemExit("--context-len: must be >= 1")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: no CUDA device present")
    try:
        target: ModelArgs = resolve_target(args.preset)
    except ModelError as exc:
        raise SystemExit(f"--preset: {exc}") from None
    dtype = getattr(torch, args.dtype)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    sw = software_facts()
    result: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "software": {
            "torch": sw.torch,
            "triton": sw.triton,
            "cuda": sw.cuda,
            "spectune": sw.spectune,
        },
        "target": target.name,
        "dtype": args.dtype,
        "device": str(device),
        "batches": batches,
        "context_len": args.context_len,
        "compile_backend": args.compile_backend,
        "attention": args.attention,
        "points": [],
    }
    say(
        f"{result['gpu']}: torch {sw.torch}, triton {sw.triton}; {target.name} {args.dtype}, "
        f"batches {batches}, context {args.context_len}"
    )
    model = build_target(
        target, device=device, dtype=dtype, generator=torch.Generator(device=device).manual_seed(0)
    )
    result["build_s"] = time.perf_counter() - started
    say(f"  built in {result['build_s']:.1f} s")
    # the first batch, and the first in LT_ROWS (fused_lt's cuBLASLt path runs there only)
    lt = next((b for b in batches if b in LT_ROWS and b != batches[0]), None)
    for key, b in (("check", batches[0]), ("check_lt_rows", lt)):
        if b is None:
            continue
        try:
            result[key] = check_fused(model, b, args.context_len, args.attention)
            say(f"  fused arms vs unfused logits at b={b}: {result[key]}")
        except Exception as exc:
            result[key] = {"error": first_line(exc)}
            say(f"  {key}: {result[key]['error']}")
    free_device_memory()
    timer = default_timer(device)
    layer_fn = None
    if not args.no_compiled:
        torch._dynamo.config.cache_size_limit = max(
            torch._dynamo.config.cache_size_limit, 2 * len(batches)
        )
        layer_fn = torch.compile(
            reference_layer, backend=args.compile_backend, dynamic=False, fullgraph=True
        )
    for arm in (*ARMS, *(() if args.no_compiled else ("compiled",))):
        result["points"] += run_arm(
            arm, model, batches, args.context_len, timer, layer_fn, args.attention
        )
    result["wall_s"] = time.perf_counter() - started
    print_table(result)
    path = out / "fused_step.json"
    atomic_write_text(path, json.dumps(result, indent=1, default=str) + "\n")
    say(f"\n{result['wall_s']:.0f} s; wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
