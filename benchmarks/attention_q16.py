"""Where the time of 16-token verification attention goes: one loop, stages left out.

The shipped kernel (``spectune.kernels.attention``) reads each KV block once for all G x q query
rows of a kv head; at q = 16 (64 rows) it runs 1.15-1.20x its q = 1 time. This script times a
stripped copy of its unmasked main loop (no causal tail, no KV split; every request at the full
context and q tokens) in variants that leave one stage out or change one step, so the differences
place the time without hardware counters:

    loads   K and V tiles loaded and summed, no dot, no softmax (the access pattern's floor)
    dots    Q.K^T and P.V with P = the raw scores (no softmax)
    full    the shipped loop: online softmax, acc and l rescaled every tile
    lazy    the running max moves only when a row's tile max passes it by more than
            ``LAZY_LOG2`` (log2 units); acc and l are rescaled only in those tiles, else the
            probabilities are taken against the old max (<= 2^LAZY_LOG2, exact in fp32)

Each variant is timed at q = 1 and q = 16 (rows G x q, padded to 16) over a paged cache of
16-token blocks scattered over the pool, as CUDA-graph replays of back-to-back calls; the table
prints us, % of the copy bandwidth and time(q) / time(q = 1). ``full`` and ``lazy`` are checked
against ``verify_attention_ref`` first.

    python benchmarks/attention_q16.py --out-dir $OUT [--batches 64,256] [--contexts 2048,8192]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from spectune.io import atomic_write_text
from spectune.kernels.attention import verify_attention, verify_attention_ref
from spectune.kernels.attention_metadata import AttnMeta

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_common import graph_replay_us, int_list  # noqa: E402  (the probes' shared helpers)

N_HEADS, N_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
VARIANTS = ("loads", "dots", "full", "lazy")
LAZY_LOG2 = 8.0
KERNELS: dict[tuple, dict[str, int]] = {}  # (variant, block_m, block_n, warps, stages) -> registers, spills, smem


@triton.jit
def _q16_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, out_ptr,
                stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt,
                ctx, q_tokens, qk_scale,
                G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                BLOCK_SIZE: tl.constexpr, VARIANT: tl.constexpr, LAZY_LOG2: tl.constexpr,
                DOT_F32: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    j = rows // G
    heads = kvh * G + rows % G
    row_ok = j < q_tokens
    d = tl.arange(0, HEAD_DIM)
    t = b * q_tokens + j
    q = tl.load(q_ptr + t[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_kh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start in range(0, ctx, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        blk = tl.load(bt_row + n // BLOCK_SIZE).to(tl.int64)
        off = n % BLOCK_SIZE
        kv_off = blk[:, None] * stride_kb + off[:, None] * stride_ks + d[None, :]
        k = tl.load(k_base + kv_off)
        v = tl.load(v_base + kv_off)
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if VARIANT == "loads":
            acc += tl.sum(k.to(tl.float32) + v.to(tl.float32), 0)[None, :]
        else:
            s = tl.dot(q, tl.trans(k))
            if VARIANT == "dots":
                acc = tl.dot(s.to(v.dtype), v, acc)
            elif VARIANT == "full":
                m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
                alpha = tl.math.exp2(m_i - m_new)
                p = tl.math.exp2(s * qk_scale - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                acc = acc * alpha[:, None]
                acc = tl.dot(p.to(v.dtype), v, acc)
                m_i = m_new
            else:  # lazy
                m_tile = tl.max(s, 1) * qk_scale
                if tl.max(m_tile - m_i, 0) > LAZY_LOG2:
                    m_new = tl.maximum(m_i, m_tile)
                    alpha = tl.math.exp2(m_i - m_new)
                    l_i = l_i * alpha
                    acc = acc * alpha[:, None]
                    m_i = m_new
                p = tl.math.exp2(s * qk_scale - m_i[:, None])
                l_i += tl.sum(p, 1)
                acc = tl.dot(p.to(v.dtype), v, acc)
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + t[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def run_variant(variant: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                tables: torch.Tensor, ctx: int, q_tokens: int, out: torch.Tensor, *,
                block_n: int = 64, num_warps: int = 4, num_stages: int = 2) -> torch.Tensor:
    """Attention of ``q_tokens`` tokens per request over ``ctx`` cached keys each, no causal mask
    (every new token sees the whole context: the main loop only). ``ctx`` is a multiple of block_n."""
    batch = tables.shape[0]
    group = N_HEADS // N_KV_HEADS
    block_m = max(16, triton.next_power_of_2(group * q_tokens))
    kernel = _q16_kernel[(batch, N_KV_HEADS)](
        q, k_cache, v_cache, tables, out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), tables.stride(0),
        ctx, q_tokens, (1.0 / math.sqrt(HEAD_DIM)) * math.log2(math.e),
        G=group, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=HEAD_DIM, BLOCK_SIZE=BLOCK_SIZE,
        VARIANT=variant, LAZY_LOG2=LAZY_LOG2, DOT_F32=q.device.type != "cuda",
        num_warps=num_warps if q.device.type == "cuda" else 1,
        num_stages=num_stages if q.device.type == "cuda" else 1,
    )
    if q.device.type == "cuda" and hasattr(kernel, "n_regs"):
        KERNELS[(variant, block_m, block_n, num_warps, num_stages)] = {
            "registers": kernel.n_regs, "spills": kernel.n_spills, "shared_bytes": kernel.metadata.shared}
    return out


def make_inputs(batch: int, ctx: int, q_tokens: int, device: str, dtype: torch.dtype, seed: int = 0):
    """A paged cache of ``batch`` requests x ``ctx`` tokens in shuffled 16-token blocks, queries."""
    gen = torch.Generator(device=device).manual_seed(seed)  # drawn where they live: 8 GiB of KV at 256 x 8192
    per = ctx // BLOCK_SIZE
    blocks = batch * per

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=dtype)

    k_cache = randn(blocks, BLOCK_SIZE, N_KV_HEADS, HEAD_DIM)
    v_cache = randn(blocks, BLOCK_SIZE, N_KV_HEADS, HEAD_DIM)
    tables = torch.randperm(blocks, generator=gen, device=device).to(torch.int32).reshape(batch, per)
    q = randn(batch * q_tokens, N_HEADS, HEAD_DIM)
    return q, k_cache, v_cache, tables


def meta_for(tables: torch.Tensor, ctx: int, q_tokens: int) -> AttnMeta:
    """Every request: q_tokens new tokens, ctx cached keys in all (its new tokens included)."""
    batch, device = tables.shape[0], tables.device
    return AttnMeta(
        cu_seqlens_q=torch.arange(0, (batch + 1) * q_tokens, q_tokens, dtype=torch.int32, device=device),
        context_lens=torch.full((batch,), ctx - q_tokens, dtype=torch.int32, device=device),
        max_q=q_tokens, block_tables=tables)


def reference(q, k_cache, v_cache, tables, ctx: int, q_tokens: int) -> torch.Tensor:
    """verify_attention_ref without the causal mask: every new token sees all ctx keys."""
    return verify_attention_ref(q, k_cache, v_cache, meta_for(tables, ctx, q_tokens), causal=False)


def replay_us(fn, reps: int = 25, calls: int = 20) -> float:
    return graph_replay_us(fn, reps, calls)


def copy_gbs() -> float:
    src = torch.empty(1 << 29, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    us = replay_us(lambda: dst.copy_(src), calls=5)
    return 2 * src.numel() * 4 / (us * 1e-6) / 1e9


def time_shape(ctx: int, batch: int, q_tokens: int, config: tuple[int, int, int], variants: list[str],
               bw: float, base: dict[str, float]) -> list[dict]:
    """Each variant, then the shipped kernel (causal, its own config), on one set of inputs;
    ``base`` holds each variant's q = 1 time of this shape (the first q timed)."""
    bn, nw, ns = config
    q, kc, vc, bt = make_inputs(batch, ctx, q_tokens, "cuda", torch.bfloat16)
    out = torch.empty_like(q)
    kv_bytes = 2 * batch * ctx * N_KV_HEADS * HEAD_DIM * 2
    calls = {v: (lambda v=v: run_variant(v, q, kc, vc, bt, ctx, q_tokens, out,
                                         block_n=bn, num_warps=nw, num_stages=ns)) for v in variants}
    meta = meta_for(bt, ctx, q_tokens)
    calls["shipped"] = lambda: verify_attention(q, kc, vc, meta, out=out)
    rows = []
    for variant, fn in calls.items():
        us = replay_us(fn)
        base.setdefault(variant, us)
        row = {"context": ctx, "batch": batch, "q": q_tokens, "variant": variant, "us": us,
               "pct_copy": 100 * kv_bytes / (us * 1e-6) / 1e9 / bw, "over_q1": us / base[variant]}
        label = "table" if variant == "shipped" else f"{bn}/{nw}/{ns}"
        if variant != "shipped":
            row.update(block_n=bn, num_warps=nw, num_stages=ns)
        rows.append(row)
        print(f"{ctx:>5} {batch:>5} {q_tokens:>3} {label:>8} {variant:>7} {us:8.1f} "
              f"{row['pct_copy']:6.1f} {row['over_q1']:5.2f}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--contexts", default="2048,8192")
    ap.add_argument("--qs", default="1,16")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--configs", default="64/4/2",
                    help="block_n/num_warps/num_stages, comma-separated (default 64/4/2, the shipped q=16 one)")
    ap.add_argument("--out-dir", default=os.environ.get("OUT", "."))
    ap.add_argument("--launch-once", action="store_true",
                    help="launch each variant and the shipped kernel once per shape, no timing (for ncu)")
    args = ap.parse_args(argv)
    batches = int_list(args.batches, "--batches", example="64,256")
    contexts = int_list(args.contexts, "--contexts", lo=512, example="2048,8192")
    qs = int_list(args.qs, "--qs", hi=16, example="1,16")
    variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        print(f"attention_q16: --variants: unknown {bad}; known {list(VARIANTS)}", file=sys.stderr)
        return 2
    configs = []
    for text in args.configs.split(","):
        try:
            bn, nw, ns = (int(x) for x in text.split("/"))
        except ValueError:
            print(f"attention_q16: --configs: want block_n/num_warps/num_stages, got {text!r}", file=sys.stderr)
            return 2
        configs.append((bn, nw, ns))
    top = max(bn for bn, _, _ in configs)
    if any(ctx % top for ctx in contexts):
        print(f"attention_q16: --contexts: each must be a multiple of the largest block_n {top}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("attention_q16: needs a CUDA GPU", file=sys.stderr)
        return 2
    dtype = torch.bfloat16
    if args.launch_once:
        for ctx in contexts:
            for batch in batches:
                for q_tokens in qs:
                    q, kc, vc, bt = make_inputs(batch, ctx, q_tokens, "cuda", dtype)
                    verify_attention(q, kc, vc, meta_for(bt, ctx, q_tokens))
                    for variant in variants:
                        for bn, nw, ns in configs:
                            run_variant(variant, q, kc, vc, bt, ctx, q_tokens, torch.empty_like(q),
                                        block_n=bn, num_warps=nw, num_stages=ns)
        torch.cuda.synchronize()
        return 0
    bw = copy_gbs()
    print(f"copy bandwidth {bw:.0f} GB/s")
    errors = {}
    for q_tokens in qs:  # correctness first
        q, kc, vc, bt = make_inputs(4, 512, q_tokens, "cuda", dtype, seed=q_tokens)
        ref = reference(q, kc, vc, bt, 512, q_tokens)
        for variant in ("full", "lazy"):
            for bn, nw, ns in configs:
                out = run_variant(variant, q, kc, vc, bt, 512, q_tokens, torch.empty_like(q),
                                  block_n=bn, num_warps=nw, num_stages=ns)
                err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                errors[f"{variant} q{q_tokens} {bn}/{nw}/{ns}"] = err
                if not err < 2e-2:
                    print(f"attention_q16: {variant} q={q_tokens} config {bn}/{nw}/{ns} is wrong "
                          f"(max rel err {err:.3g})", file=sys.stderr)
                    return 1
    rows: list[dict] = []
    print(f"{'ctx':>5} {'batch':>5} {'q':>3} {'config':>8} {'variant':>7} {'us':>8} {'%copy':>6} {'/q1':>5}")
    for ctx in contexts:
        for batch in batches:
            for config in configs:
                base: dict[str, float] = {}
                for q_tokens in qs:
                    rows += time_shape(ctx, batch, q_tokens, config, variants, bw, base)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "copy_gbs": bw, "lazy_log2": LAZY_LOG2, "errors": errors, "rows": rows,
              "kernels": [{"variant": k[0], "block_m": k[1], "block_n": k[2], "num_warps": k[3],
                           "num_stages": k[4], **v} for k, v in KERNELS.items()]}
    for k, v in KERNELS.items():
        print("kernel", k, v)
    path = Path(args.out_dir) / "attention_q16.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
