"""What the verification-attention kernels cost an SM, compiled for a GPU this machine need not have.

Triton compiles a kernel for any NVIDIA target with the ptxas it ships, no driver needed; this
script compiles the shipped kernel (``spectune.kernels.attention._verify_attn_kernel``) and the
variants of ``attention_q16.py`` (``shipped-lazy``: the shipped kernel with ``AttnConfig.lazy``) for ``--arch`` (default sm_90, the H200) at each config, with
the integer arguments specialized as a launch specializes them (pointers and strides divisible by
16, except those the kernel marks ``do_not_specialize``), and prints per config: registers per
thread, dynamic shared memory, local (spill) bytes, the CTAs an SM holds by each of the two and by
warps (65 536 registers, 228 KiB of shared memory and 64 warps an SM on sm_90), and the
instruction mix of the PTX (tensor-core ops, async copies, exp2). A static view: how many CTAs
hide the memory latency, and where the registers go, before a GPU call is spent on timing.

    python benchmarks/attention_resources.py [--arch 90] [--configs 64/64/4/2,16/64/4/2] [--max-regs N] [--out FILE]

A config is block_m/block_n/num_warps/num_stages; head_dim 128, G = 4 query heads per kv head,
16-token KV blocks, bf16 (qwen3-8b). Needs Triton's NVIDIA backend (its ptxas and cuobjdump).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from spectune.io import atomic_write_text
from spectune.kernels.attention import _verify_attn_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
import attention_q16  # noqa: E402  (its stripped loop and variants)

REGS_PER_SM, SMEM_PER_SM, WARPS_PER_SM = 65536, 228 * 1024, 64
SHIPPED = {"shipped": False, "shipped-lazy": True}  # the shipped kernel, exact or lazy (``AttnConfig.lazy``)
OPS = ("wgmma.mma_async", "mma.sync", "cp.async.cg", "cp.async.bulk", "ld.global", "ex2.approx")


def _types(fn: Any, pointers: dict[str, str], floats: tuple[str, ...], constexprs: dict[str, Any]) -> dict[str, str]:
    return {n: pointers.get(n, "constexpr" if n in constexprs else "fp32" if n in floats else "i32")
            for n in fn.arg_names}


def compile_kernel(fn: Any, types: dict[str, str], constexprs: dict[str, Any], warps: int, stages: int,
                   arch: int, max_regs: int = 0) -> Any:
    names = list(types)
    skip = set(getattr(fn, "do_not_specialize", ()) or ())
    div = [n for n in names if types[n].startswith("*") or (n.startswith("stride") and n not in skip)]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div}
    src = ASTSource(fn=fn, signature=types, constexprs=constexprs, attrs=attrs)
    options: dict[str, Any] = {"num_warps": warps, "num_stages": stages}
    if max_regs:
        options["maxnreg"] = max_regs  # as a launch with AttnConfig.max_regs passes it
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def shipped(block_m: int, block_n: int, warps: int, stages: int, arch: int, split: bool = False,
            lazy: bool = False, max_regs: int = 0) -> Any:
    consts = {"HEAD_DIM": 128, "BLOCK_SIZE": 16, "CAUSAL": True, "G": 4, "M_TILES": 1, "BLOCK_M": block_m,
              "BLOCK_N": block_n, "BLOCK_D": 128, "SPLIT": split, "DOT_PRECISION": "tf32", "DOT_F32": False,
              "LAZY": lazy}
    ptrs = {n: "*bf16" for n in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")}
    ptrs.update({n: "*i32" for n in ("block_tables_ptr", "cu_seqlens_q_ptr", "context_lens_ptr")})
    ptrs.update({n: "*fp32" for n in ("part_o_ptr", "part_lse_ptr")})
    fn = _verify_attn_kernel
    return compile_kernel(fn, _types(fn, ptrs, ("qk_scale",), consts), consts, warps, stages, arch, max_regs)


def variant(name: str, block_m: int, block_n: int, warps: int, stages: int, arch: int) -> Any:
    consts = {"G": 4, "BLOCK_M": block_m, "BLOCK_N": block_n, "HEAD_DIM": 128, "BLOCK_SIZE": 16, "VARIANT": name,
              "LAZY_LOG2": attention_q16.LAZY_LOG2, "DOT_F32": False}
    ptrs = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")}
    ptrs["bt_ptr"] = "*i32"
    fn = attention_q16._q16_kernel
    return compile_kernel(fn, _types(fn, ptrs, ("qk_scale",), consts), consts, warps, stages, arch)


def resources(kernel: Any, warps: int) -> dict[str, Any]:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        text = subprocess.run([str(tool), "-res-usage", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
    m = re.search(r"REG:(\d+).*?LOCAL:(\d+)", text, re.S)
    if m is None:
        raise RuntimeError(f"cuobjdump: no resource line in {text[-200:]!r}")
    regs, local = int(m.group(1)), int(m.group(2))
    smem = int(kernel.metadata.shared)
    by_regs = REGS_PER_SM // (regs * 32 * warps) if regs else WARPS_PER_SM // warps
    by_smem = SMEM_PER_SM // smem if smem else WARPS_PER_SM // warps
    ptx = kernel.asm["ptx"]
    mix = collections.Counter()
    for op in OPS:
        mix[op] = len(re.findall(rf"^\s*{re.escape(op)}", ptx, re.M))
    return {"registers": regs, "shared_bytes": smem, "local_bytes": local, "ctas_by_registers": by_regs,
            "ctas_by_shared": by_smem, "ctas_by_warps": WARPS_PER_SM // warps,
            "ctas": min(by_regs, by_smem, WARPS_PER_SM // warps), "ptx_ops": dict(mix)}


def parse_configs(text: str) -> list[tuple[int, int, int, int]]:
    out = []
    for part in text.split(","):
        try:
            bm, bn, w, s = (int(x) for x in part.split("/"))
        except ValueError:
            raise SystemExit(f"--configs: {part!r} is not block_m/block_n/num_warps/num_stages") from None
        if min(bm, bn, w, s) < 1:
            raise SystemExit(f"--configs: {part!r}: every part must be >= 1")
        out.append((bm, bn, w, s))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (default 90: H100/H200)")
    ap.add_argument("--configs", default="16/64/4/2,64/64/4/2,64/64/4/3,64/32/4/3,64/64/8/2")
    ap.add_argument("--variants", default="shipped,shipped-lazy,full,lazy,dots,loads")
    ap.add_argument("--max-regs", type=int, default=0,
                    help="the shipped kernels' register cap (AttnConfig.max_regs; default: the compiler's choice)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    configs = parse_configs(args.configs)
    names = [v for v in args.variants.split(",") if v]
    bad = [v for v in names if v not in SHIPPED and v not in attention_q16.VARIANTS]
    if bad:
        raise SystemExit(f"--variants: unknown {bad}; known {', '.join(SHIPPED)}, {', '.join(attention_q16.VARIANTS)}")
    if not hasattr(_verify_attn_kernel, "cache_key"):  # an interpreted kernel has no compiler path
        print("attention_resources: the kernels run in Triton's interpreter here; unset TRITON_INTERPRET",
              file=sys.stderr)
        return 2
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    rows = []
    print(f"{'kernel':<12} {'config':>10} {'regs':>5} {'smem KiB':>8} {'spill':>5} {'CTAs/SM (regs smem warps)':>26}  ptx ops")
    for name in names:
        for bm, bn, w, s in configs:
            k = (shipped(bm, bn, w, s, args.arch, lazy=SHIPPED[name], max_regs=args.max_regs) if name in SHIPPED
                 else variant(name, bm, bn, w, s, args.arch))
            r = {"kernel": name, "block_m": bm, "block_n": bn, "num_warps": w, "num_stages": s,
                 "max_regs": args.max_regs if name in SHIPPED else 0, **resources(k, w)}
            rows.append(r)
            ops = " ".join(f"{op.split('.')[0] if op != 'mma.sync' else 'mma'}:{n}" for op, n in r["ptx_ops"].items() if n)
            print(f"{name:<12} {bm}/{bn}/{w}/{s:<3} {r['registers']:>5} {r['shared_bytes'] / 1024:>8.1f} "
                  f"{r['local_bytes']:>5} {r['ctas']:>6} ({r['ctas_by_registers']} {r['ctas_by_shared']} "
                  f"{r['ctas_by_warps']})        {ops}", flush=True)
    if args.out:
        atomic_write_text(Path(args.out), json.dumps({"arch": args.arch, "triton": triton.__version__,
                                                       "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
