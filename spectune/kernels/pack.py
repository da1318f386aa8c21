"""Ragged packing of one verification step into a captured tier of ``T`` token rows.

Request i contributes ``q_i = 1 + grant[i]`` rows, back to back in request order: its last real
token, then its granted drafts. Row j of request i sits at position ``context_lens[i] + j`` and KV
slot ``block_tables[i, pos // block_size] * block_size + pos % block_size``. Rows after the packed
total are padding: token ``PAD_TOKEN_ID``, position ``PAD_POSITION``, slot ``PAD_SLOT`` (attention
and cache writes skip it), request ``PAD_REQUEST``.

Only the first ``num_reqs`` requests are live (a device scalar, so one graph serves every batch up
to its static size); the others get zero rows (so do requests past the tier's row count: the
host must keep ``num_reqs <= T``). If grants would overflow the tier, they are cut in
request order so the packed total never exceeds ``T``: the inclusive running sum of grants is
clamped to ``T - num_reqs`` (later requests lose drafts first, real tokens are never cut). The
planner's budget should make that a no-op; ``grant_used`` reports what was packed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from spectune.kernels.kv_cache import PAD_SLOT, check

PAD_TOKEN_ID = 0  # token of a padding row (a valid id, so embeddings stay in range)
PAD_POSITION = 0  # position of a padding row
PAD_REQUEST = -1  # token_req of a padding row


@dataclass(frozen=True)
class PackedBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, PAD_SLOT on padding rows
    token_req: torch.Tensor  # [T] int32, request of each row, PAD_REQUEST on padding rows
    cu_seqlens_q: torch.Tensor  # [B+1] int32, query start offsets
    grant_used: torch.Tensor  # [B] int32, drafts packed per request (<= grant)

    @classmethod
    def empty(cls, batch: int, tier: int, device: torch.device | str) -> PackedBatch:
        def rows() -> torch.Tensor:
            return torch.zeros(tier, dtype=torch.int64, device=device)

        return cls(
            input_ids=rows(),
            positions=rows(),
            slot_mapping=rows(),
            token_req=torch.zeros(tier, dtype=torch.int32, device=device),
            cu_seqlens_q=torch.zeros(batch + 1, dtype=torch.int32, device=device),
            grant_used=torch.zeros(batch, dtype=torch.int32, device=device),
        )

    @property
    def tier(self) -> int:
        return self.input_ids.shape[0]


# ---------------------------------------------------------------------------------------------
# Reference


def pack_ref(
    last_token: torch.Tensor,  # [B] int64
    drafts: torch.Tensor,  # [B, K] int64
    grant: torch.Tensor,  # [B] int32
    context_lens: torch.Tensor,  # [B] int32
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    block_size: int,
    tier: int,
    num_reqs: int | torch.Tensor | None = None,
) -> PackedBatch:
    """Row-by-row python loop; same outputs as :func:`pack`."""
    batch, max_k = drafts.shape
    live = batch if num_reqs is None else _host_int(num_reqs)
    live = max(0, min(live, batch, tier))
    out = PackedBatch.empty(batch, tier, "cpu")
    out.input_ids.fill_(PAD_TOKEN_ID)
    out.positions.fill_(PAD_POSITION)
    out.slot_mapping.fill_(PAD_SLOT)
    out.token_req.fill_(PAD_REQUEST)
    spare = max(0, tier - live)  # draft rows the tier can hold
    row = 0
    for i in range(batch):
        if i < live:
            g = min(max(int(grant[i]), 0), max_k, spare)
            spare -= g
            tokens = [int(last_token[i])] + [int(d) for d in drafts[i, :g]]
            for j, tok in enumerate(tokens):
                if row >= tier:
                    break
                pos = int(context_lens[i]) + j
                col = pos // block_size
                out.input_ids[row] = tok
                out.positions[row] = pos
                if col < block_tables.shape[1]:
                    out.slot_mapping[row] = int(block_tables[i, col]) * block_size + pos % block_size
                out.token_req[row] = i
                row += 1
            out.grant_used[i] = g
        out.cu_seqlens_q[i + 1] = row
    return out


def _host_int(value: int | torch.Tensor) -> int:
    return int(value.reshape(-1)[0]) if isinstance(value, torch.Tensor) else int(value)


# ---------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _pack_offsets_kernel(
    # Pointers
    grant_ptr,  # [B] int32
    num_reqs_ptr,  # [1] int32 (read when NUM_REQS_ON_DEVICE)
    cu_seqlens_q_ptr,  # [B+1] int32, output
    grant_used_ptr,  # [B] int32, output
    # Dimensions
    batch,
    max_k,
    tier,
    num_reqs_value,
    # Meta-parameters
    NUM_REQS_ON_DEVICE: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    live = tl.load(num_reqs_ptr) if NUM_REQS_ON_DEVICE else num_reqs_value
    live = tl.minimum(tl.maximum(live, 0), tl.minimum(batch, tier))
    spare = tl.maximum(tier - live, 0)  # draft rows the tier can hold
    tl.store(cu_seqlens_q_ptr, 0)
    drafts_before = 0  # clamped grants of earlier chunks
    for start in range(0, batch, BLOCK_B):
        req = start + tl.arange(0, BLOCK_B)
        is_live = req < live
        g = tl.load(grant_ptr + req, mask=is_live, other=0)
        g = tl.minimum(tl.maximum(g, 0), max_k)
        # clamped inclusive sum: min(sum of grants so far, spare)
        incl = tl.minimum(drafts_before + tl.cumsum(g, axis=0), spare)
        excl = tl.minimum(drafts_before + tl.cumsum(g, axis=0) - g, spare)
        tl.store(grant_used_ptr + req, incl - excl, mask=req < batch)
        rows_end = tl.minimum(req + 1, live) + incl
        tl.store(cu_seqlens_q_ptr + 1 + req, rows_end, mask=req < batch)
        drafts_before = tl.minimum(drafts_before + tl.sum(g, axis=0), spare)


@triton.jit
def _pack_rows_kernel(
    # Pointers
    last_token_ptr,  # [B] int64
    drafts_ptr,  # [B, K] int64
    context_lens_ptr,  # [B] int32
    block_tables_ptr,  # [B, max_blocks] int32
    cu_seqlens_q_ptr,  # [B+1] int32
    input_ids_ptr,  # [T] int64, output
    positions_ptr,  # [T] int64, output
    slot_mapping_ptr,  # [T] int64, output
    token_req_ptr,  # [T] int32, output
    # Dimensions
    batch,
    max_k,
    max_blocks,
    tier,
    block_size,
    n_req_programs,
    # Meta-parameters
    PAD_TOKEN: tl.constexpr,
    PAD_POS: tl.constexpr,
    PAD_SLOT_ID: tl.constexpr,
    PAD_REQ: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < n_req_programs:
        # a block of requests: row j of request i -> packed row cu[i] + j
        req = pid * BLOCK_B + tl.arange(0, BLOCK_B)
        req_ok = req < batch
        start = tl.load(cu_seqlens_q_ptr + req, mask=req_ok, other=0)
        q_len = tl.load(cu_seqlens_q_ptr + req + 1, mask=req_ok, other=0) - start
        j = tl.arange(0, BLOCK_Q)[None, :]
        row = start[:, None] + j
        keep = req_ok[:, None] & (j < q_len[:, None]) & (row < tier)
        last = tl.load(last_token_ptr + req, mask=req_ok, other=PAD_TOKEN)
        draft = tl.load(drafts_ptr + req[:, None] * max_k + (j - 1), mask=keep & (j >= 1), other=PAD_TOKEN)
        token = tl.where(j == 0, last[:, None], draft)
        pos = tl.load(context_lens_ptr + req, mask=req_ok, other=0).to(tl.int64)[:, None] + j
        col = pos // block_size
        in_table = keep & (col < max_blocks)
        block = tl.load(block_tables_ptr + req[:, None] * max_blocks + col, mask=in_table, other=0)
        slot = tl.where(in_table, block.to(tl.int64) * block_size + pos % block_size, PAD_SLOT_ID)
        tl.store(input_ids_ptr + row, token, mask=keep)
        tl.store(positions_ptr + row, pos, mask=keep)
        tl.store(slot_mapping_ptr + row, slot, mask=keep)
        tl.store(token_req_ptr + row, (req[:, None] + j * 0).to(tl.int32), mask=keep)
    else:
        # a block of rows: those at or after the packed total are padding
        tail = (pid - n_req_programs) * BLOCK_T + tl.arange(0, BLOCK_T)
        total = tl.load(cu_seqlens_q_ptr + batch)
        pad = (tail < tier) & (tail >= total)
        tl.store(input_ids_ptr + tail, tl.full((BLOCK_T,), PAD_TOKEN, tl.int64), mask=pad)
        tl.store(positions_ptr + tail, tl.full((BLOCK_T,), PAD_POS, tl.int64), mask=pad)
        tl.store(slot_mapping_ptr + tail, tl.full((BLOCK_T,), PAD_SLOT_ID, tl.int64), mask=pad)
        tl.store(token_req_ptr + tail, tl.full((BLOCK_T,), PAD_REQ, tl.int32), mask=pad)


def _check_pack_inputs(last_token, drafts, grant, context_lens, block_tables, block_size, tier, out):
    check(drafts.ndim == 2, "drafts", f"must be [B, K], got shape {tuple(drafts.shape)}")
    batch = drafts.shape[0]
    device = drafts.device
    for name, t, dtype, shape in (
        ("last_token", last_token, torch.int64, (batch,)),
        ("drafts", drafts, torch.int64, tuple(drafts.shape)),
        ("grant", grant, torch.int32, (batch,)),
        ("context_lens", context_lens, torch.int32, (batch,)),
    ):
        check(t.shape == shape, name, f"must be {list(shape)}, got {list(t.shape)}")
        check(t.dtype == dtype, name, f"must be {dtype}, got {t.dtype}")
        check(t.device == device, name, f"on {t.device}, drafts on {device}")
        check(t.is_contiguous(), name, "must be contiguous")
    check(block_tables.ndim == 2 and block_tables.shape[0] == batch, "block_tables",
          f"must be [{batch}, max_blocks], got {list(block_tables.shape)}")
    check(block_tables.dtype == torch.int32, "block_tables", f"must be int32, got {block_tables.dtype}")
    check(block_tables.is_contiguous() and block_tables.device == device, "block_tables",
          f"must be contiguous on {device}")
    check(block_size >= 1, "block_size", f"must be >= 1, got {block_size}")
    check(tier >= 1, "tier", f"must be >= 1, got {tier}")
    row_dtypes = {"input_ids": torch.int64, "positions": torch.int64, "slot_mapping": torch.int64,
                  "token_req": torch.int32}
    for name, dtype in row_dtypes.items():
        t = getattr(out, name)
        check(t.shape == (tier,) and t.dtype == dtype, f"out.{name}",
              f"must be [{tier}] {dtype}, got {list(t.shape)} {t.dtype}")
    check(out.cu_seqlens_q.shape == (batch + 1,) and out.cu_seqlens_q.dtype == torch.int32,
          "out.cu_seqlens_q", f"must be [{batch + 1}] int32")
    check(out.grant_used.shape == (batch,) and out.grant_used.dtype == torch.int32,
          "out.grant_used", f"must be [{batch}] int32")
    for name in ("input_ids", "positions", "slot_mapping", "token_req", "cu_seqlens_q", "grant_used"):
        t = getattr(out, name)
        check(t.device == device and t.is_contiguous(), f"out.{name}", f"must be contiguous on {device}")


def pack(
    last_token: torch.Tensor,  # [B] int64
    drafts: torch.Tensor,  # [B, K] int64
    grant: torch.Tensor,  # [B] int32
    context_lens: torch.Tensor,  # [B] int32, tokens already in the KV cache
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    block_size: int,
    tier: int,
    *,
    num_reqs: int | torch.Tensor | None = None,  # live requests: python int or [1] int32 device
    out: PackedBatch | None = None,
) -> PackedBatch:
    """Pack each live request's real token and granted drafts into ``tier`` rows. Capturable."""
    if out is None:
        out = PackedBatch.empty(drafts.shape[0] if drafts.ndim == 2 else 0, tier, drafts.device)
    _check_pack_inputs(last_token, drafts, grant, context_lens, block_tables, block_size, tier, out)
    batch, max_k = drafts.shape
    on_device = isinstance(num_reqs, torch.Tensor)
    if on_device:
        assert isinstance(num_reqs, torch.Tensor)
        check(num_reqs.numel() == 1 and num_reqs.dtype == torch.int32, "num_reqs",
              f"must be one int32 value, got {tuple(num_reqs.shape)} {num_reqs.dtype}")
        check(num_reqs.device == drafts.device, "num_reqs", f"on {num_reqs.device}, drafts on {drafts.device}")
    live = batch if num_reqs is None or isinstance(num_reqs, torch.Tensor) else int(num_reqs)
    block_b = min(triton.next_power_of_2(max(batch, 1)), 256)
    _pack_offsets_kernel[(1,)](
        grant, num_reqs if on_device else grant, out.cu_seqlens_q, out.grant_used,
        batch, max_k, tier, max(0, min(live, batch, tier)),
        NUM_REQS_ON_DEVICE=on_device,
        BLOCK_B=block_b,
        num_warps=4,
    )
    rows_b = 16
    block_t = min(triton.next_power_of_2(tier), 1024)
    n_req_programs = triton.cdiv(batch, rows_b)
    grid = (n_req_programs + triton.cdiv(tier, block_t),)
    _pack_rows_kernel[grid](
        last_token, drafts, context_lens, block_tables, out.cu_seqlens_q,
        out.input_ids, out.positions, out.slot_mapping, out.token_req,
        batch, max_k, block_tables.shape[1], tier, block_size, n_req_programs,
        PAD_TOKEN=PAD_TOKEN_ID,
        PAD_POS=PAD_POSITION,
        PAD_SLOT_ID=PAD_SLOT,
        PAD_REQ=PAD_REQUEST,
        BLOCK_B=rows_b,
        BLOCK_Q=triton.next_power_of_2(max_k + 1),
        BLOCK_T=block_t,
        num_warps=4,
    )
    return out


# ---------------------------------------------------------------------------------------------
# Padding accounting (host side, for benchmarks and the tuner)


@dataclass(frozen=True)
class PaddingWaste:
    tokens: int  # real rows: batch + sum(grants)
    tier: int | None  # smallest tier >= tokens (None: above every tier)
    tier_pad_rows: int | None  # tier - tokens
    request_pad_rows: int  # batch * max_q - tokens, every request padded to max_q


def padding_waste(grants: Sequence[int], tiers: Sequence[int], max_q: int | None = None) -> PaddingWaste:
    """Padded rows of tier packing vs per-request padding for one step's ``grants``.

    Per-request padding gives every request ``max_q`` rows (default: the longest query of the
    step, ``1 + max(grants)``), as engines that lay a ragged batch out as [batch, max_q] do.
    """
    grants = [int(g) for g in grants]
    check(all(g >= 0 for g in grants), "grants", "must be >= 0")
    tokens = len(grants) + sum(grants)
    longest = 1 + max(grants, default=0)
    if max_q is None:
        max_q = longest
    check(max_q >= longest, "max_q", f"{max_q} is below the longest query {longest}")
    tier = min((t for t in tiers if t >= tokens), default=None)
    return PaddingWaste(
        tokens=tokens,
        tier=tier,
        tier_pad_rows=None if tier is None else tier - tokens,
        request_pad_rows=len(grants) * max_q - tokens,
    )
