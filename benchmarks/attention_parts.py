"""A mixed step's attention in one launch or in two (``AttnMeta.parts``): one table.

    python benchmarks/attention_parts.py --out-dir $OUT [--batches 32,64] [--pieces 256,512] [--q 4]

A mixed-prefill step (``spectune.engine.mixed``) attends for ``batch`` decode/verify rows of ``q``
tokens over ``--context`` cached tokens, then for prompt pieces of ``piece`` tokens (one request,
nothing cached before it). One launch tiles every row for the longest query (the piece); two
launches tile each part for its own. qwen3-8b's attention (32 query heads, 8 KV heads, head dim
128, bf16, paged KV of 16-token blocks), CUDA-graph replay median; the two outputs are checked
against each other. ``--device cpu`` runs a small case through Triton's interpreter (a dry run of
the script, no timing worth reading).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from pathlib import Path

import torch

from spectune.io import atomic_write_text
from spectune.kernels.attention import verify_attention
from spectune.kernels.attention_metadata import AttnMeta
from spectune.kernels.kv_cache import make_block_tables

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_common import graph_replay_us, int_list, say  # noqa: E402  (the probes' shared helpers)

BLOCK = 16


def case(batch: int, q: int, context: int, piece: int, *, heads: int, kv_heads: int, head_dim: int,
         device: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttnMeta]:
    q_lens = [q] * batch + [piece]
    ctx = [context] * batch + [0]
    seq = [c + n for c, n in zip(ctx, q_lens, strict=True)]
    blocks = sum(-(-s // BLOCK) for s in seq) + 1
    meta = AttnMeta.from_lens(q_lens, ctx, device=device)
    meta.block_tables = make_block_tables(seq, BLOCK, blocks, shuffle=True, generator=gen, device=device)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shape = (blocks, BLOCK, kv_heads, head_dim)
    k = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)  # (a CPU generator: same draws anywhere)
    v = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    x = torch.randn((sum(q_lens), heads, head_dim), generator=gen).to(device=device, dtype=dtype)
    decode = AttnMeta(cu_seqlens_q=meta.cu_seqlens_q[: batch + 1], context_lens=meta.context_lens[:batch],
                      max_q=q, block_tables=meta.block_tables[:batch])
    pieces = AttnMeta(cu_seqlens_q=meta.cu_seqlens_q[batch:], context_lens=meta.context_lens[batch:],
                      max_q=piece, block_tables=meta.block_tables[batch:])
    return x, k, v, dataclasses.replace(meta, parts=(decode, pieces))


def replay_us(fn, device: str, reps: int) -> float:
    if device != "cuda":
        fn()
        return float("nan")
    return graph_replay_us(fn, reps)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--batches", default="32,64")
    ap.add_argument("--pieces", default="256,512")
    ap.add_argument("--q", type=int, default=4, help="tokens per decode/verify row (1 + K)")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    batches = int_list(args.batches, "--batches", example="32,64")
    pieces = int_list(args.pieces, "--pieces", example="256,512")
    small = args.device != "cuda"  # the interpreter: a small model of the same shape of work
    heads, kv_heads, head_dim = (8, 2, 32) if small else (32, 8, 128)
    gen = torch.Generator().manual_seed(0)
    rows = []
    say(f"{'batch':>5} {'q':>3} {'piece':>5} {'one launch us':>13} {'two launches us':>15} {'two / one':>9} "
        f"{'max |diff|':>10}")
    for b in batches:
        for p in pieces:
            x, k, v, meta = case(b, args.q, args.context, p, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                 device=args.device, gen=gen)
            whole = dataclasses.replace(meta, parts=None)
            out1, out2 = torch.empty_like(x), torch.empty_like(x)
            one = replay_us(functools.partial(verify_attention, x, k, v, whole, out=out1), args.device, args.reps)
            two = replay_us(functools.partial(verify_attention, x, k, v, meta, out=out2), args.device, args.reps)
            diff = (out1.float() - out2.float()).abs().max().item()
            rows.append({"batch": b, "q": args.q, "piece": p, "context": args.context, "one_launch_us": one,
                         "two_launches_us": two, "ratio": two / one if one == one else None, "max_abs_diff": diff})
            say(f"{b:>5} {args.q:>3} {p:>5} {one:>13.1f} {two:>15.1f} {two / one:>9.3f} {diff:>10.2e}")
    info = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu (interpreter, not timed)",
            "torch": torch.__version__, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "rows": rows}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "attention_parts.json", json.dumps(info, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
