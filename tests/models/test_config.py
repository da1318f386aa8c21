import dataclasses
import json

import pytest
import torch

from spectune.errors import SpectuneError
from spectune.kernels.attention_metadata import AttnMeta
from spectune.models.attention import DenseTorchAttention
from spectune.models.build import build_target
from spectune.models.config import (
    DTYPES,
    PRESETS,
    DrafterSpec,
    ModelArgs,
    ModelError,
    from_hf_dir,
    kv_bytes_per_token,
    param_count,
    parse_drafter,
    parse_dtype,
    projection_outputs,
    projection_params,
    projection_shapes,
    resolve_target,
    weight_bytes,
    weight_read_bytes,
)
from spectune.runtime.table import DTYPES as TABLE_DTYPES

QWEN3_8B_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "intermediate_size": 12288, "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
    "tie_word_embeddings": False,
}


def write_config(tmp_path, cfg, name="ckpt"):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_presets_have_public_shapes():
    q8 = ModelArgs.from_name("qwen3-8b")
    assert (q8.dim, q8.n_layers, q8.n_heads, q8.n_kv_heads, q8.head_dim) == (4096, 36, 32, 8, 128)
    assert q8.qk_norm and not q8.tie_embeddings and q8.group == 4
    llama = ModelArgs.from_name("LLAMA-3.1-8B")
    assert llama.rope_theta == 500000.0 and llama.vocab_size == 128256 and not llama.qk_norm
    assert ModelArgs.from_name("qwen3-0.6b").tie_embeddings
    # ~8.2B parameters, ~16 GB of bf16 weights for qwen3-8b
    assert 8.0e9 < param_count(q8) < 8.4e9
    assert weight_bytes(q8, torch.bfloat16) == 2 * param_count(q8)
    assert 0.58e9 < param_count(PRESETS["qwen3-0.6b"]) < 0.62e9
    assert 3.9e9 < param_count(PRESETS["qwen3-4b"]) < 4.1e9


def test_kv_bytes_match_the_memory_plan():
    q8 = PRESETS["qwen3-8b"]
    assert kv_bytes_per_token(q8) == 2 * 36 * 8 * 128 * 2  # 144 KiB per token
    assert kv_bytes_per_token(q8, torch.float32, n_layers=1) == 2 * 8 * 128 * 4
    assert 76e9 < kv_bytes_per_token(q8) * 256 * 2048 < 78e9


def test_unknown_preset_lists_presets():
    with pytest.raises(ModelError, match="qwen3-8b"):
        ModelArgs.from_name("gpt-5")
    with pytest.raises(SpectuneError, match="not a preset \\(tiny, "):
        resolve_target("no-such-model")


def test_from_hf_dir_reads_shapes(tmp_path):
    folder = write_config(tmp_path, QWEN3_8B_CONFIG)
    args = from_hf_dir(folder)
    ref = PRESETS["qwen3-8b"]
    assert args.name == "ckpt"
    for key in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                "intermediate_size", "rope_theta", "tie_embeddings", "qk_norm"):
        assert getattr(args, key) == getattr(ref, key), key
    assert resolve_target(str(folder)) == args


def test_from_hf_dir_defaults_head_dim_and_kv_heads(tmp_path):
    cfg = {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2,
           "num_attention_heads": 4, "intermediate_size": 512, "vocab_size": 1000}
    args = from_hf_dir(write_config(tmp_path, cfg))
    assert args.head_dim == 64 and args.n_kv_heads == 4 and not args.qk_norm


@pytest.mark.parametrize("edit, needle", [
    ({"hidden_size": None}, "'hidden_size'"),
    ({"num_hidden_layers": "36"}, "'num_hidden_layers' must be int"),
    ({"rope_theta": "big"}, "'rope_theta'"),
    ({"num_key_value_heads": 5}, "not a multiple"),
])
def test_from_hf_dir_names_file_and_key(tmp_path, edit, needle):
    cfg = dict(QWEN3_8B_CONFIG)
    for key, value in edit.items():
        if value is None:
            cfg.pop(key)
        else:
            cfg[key] = value
    folder = write_config(tmp_path, cfg)
    with pytest.raises(ModelError) as info:
        from_hf_dir(folder)
    assert str(folder / "config.json") in str(info.value)
    assert needle in str(info.value)


def test_from_hf_dir_missing_or_broken_file(tmp_path):
    with pytest.raises(ModelError, match="cannot read"):
        from_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match="not valid JSON"):
        from_hf_dir(tmp_path)


@pytest.mark.parametrize("text, spec", [
    ("eagle-1l", DrafterSpec("eagle-1l", "autoregressive", 1)),
    ("EAGLE-3l", DrafterSpec("eagle-3l", "autoregressive", 3)),
    ("mtp", DrafterSpec("mtp-1l", "autoregressive", 1)),
    ("dflash-2l", DrafterSpec("dflash-2l", "parallel", 2)),
    ("dflash", DrafterSpec("dflash-1l", "parallel", 1)),
])
def test_parse_drafter(text, spec):
    assert parse_drafter(text) == spec


@pytest.mark.parametrize("text", ["medusa-1l", "eagle-0l", "eagle-l", "eagle1l", ""])
def test_parse_drafter_rejects(text):
    with pytest.raises(ModelError, match="drafter"):
        parse_drafter(text)


# published sizes (model cards): Qwen3-32B 32.8B, Llama-3.1-8B 8.03B parameters
PUBLISHED = {"qwen3-32b": (32.7e9, 32.9e9), "llama-3.1-8b": (8.02e9, 8.04e9), "qwen3-8b": (8.1e9, 8.3e9)}


def scaled_copy(args: ModelArgs, shrink: int) -> ModelArgs:
    """The same layout (GQA group, head_dim ratio, q/k norm, tying) at 1/shrink of every width."""
    return dataclasses.replace(args, name=f"{args.name}/{shrink}", vocab_size=args.vocab_size // (16 * shrink),
                               dim=args.dim // shrink, n_layers=2, n_heads=max(args.n_heads // shrink, args.group),
                               n_kv_heads=max(args.n_kv_heads // shrink, 1), head_dim=args.head_dim // 8,
                               intermediate_size=args.intermediate_size // shrink)


def test_new_presets_have_public_config_numbers():
    q32 = PRESETS["qwen3-32b"]
    assert (q32.dim, q32.n_layers, q32.n_heads, q32.n_kv_heads, q32.head_dim, q32.intermediate_size) == (
        5120, 64, 64, 8, 128, 25600)
    assert (q32.vocab_size, q32.rope_theta, q32.rms_eps) == (151936, 1e6, 1e-6)
    assert q32.qk_norm and not q32.tie_embeddings
    llama = PRESETS["llama-3.1-8b"]
    assert (llama.dim, llama.n_layers, llama.n_heads, llama.n_kv_heads, llama.head_dim) == (4096, 32, 32, 8, 128)
    assert (llama.intermediate_size, llama.vocab_size, llama.rms_eps) == (14336, 128256, 1e-5)
    assert not llama.qk_norm and not llama.tie_embeddings and llama.rope_theta == 500000.0
    assert resolve_target("Qwen3-32B") is q32


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_param_count_formula_is_the_built_model_and_the_published_size(name):
    full = PRESETS[name]
    lo, hi = PUBLISHED[name]
    assert lo < param_count(full) < hi
    small = scaled_copy(full, 32)
    assert small.qk_norm == full.qk_norm and small.group == full.group
    for fp8 in (False, True):
        model = build_target(small, device="cpu", dtype=torch.bfloat16, fp8=fp8,
                             generator=torch.Generator().manual_seed(0))
        stored = sum(t.numel() for t in (*model.parameters(), *model.buffers()) if t.dtype != torch.float32)
        scales = sum(t.numel() for t in model.buffers() if t.dtype == torch.float32 and t.ndim == 1
                     and t is not model.rotary.inv_freq)
        assert stored == param_count(small)
        assert scales == (small.n_layers * projection_outputs(small) if fp8 else 0)
        # the bytes one step reads: everything but the embedding table (unless it is the lm_head)
        read = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())
                   if t is not model.embed and t is not model.rotary.inv_freq)
        assert weight_read_bytes(small, torch.bfloat16, fp8=fp8) == read
        attn = model.layers[0].attn
        assert (attn.q_norm is not None) == full.qk_norm
    # the builder runs a target without q/k norm (Llama) as well as with it, FP8 or not
    model.backend = DenseTorchAttention(small.n_layers, 1, 4, 3, small.n_kv_heads, small.head_dim,
                                        dtype=torch.bfloat16)
    logits = model(torch.tensor([1, 2, 3]), torch.arange(3), AttnMeta.from_lens([3], [0]))
    assert logits.shape == (3, small.vocab_size) and torch.isfinite(logits).all()


def test_fp8_reads_about_half_the_bf16_weight_bytes():
    q8 = PRESETS["qwen3-8b"]
    bf16, fp8 = weight_read_bytes(q8), weight_read_bytes(q8, fp8=True)
    head = 2 * q8.vocab_size * q8.dim  # the lm_head stays bf16
    assert fp8 - head == pytest.approx((bf16 - head) / 2, rel=1e-3)
    assert 0.45 < fp8 / bf16 < 0.55


def test_dtype_names_are_the_table_choices():
    assert tuple(DTYPES) == TABLE_DTYPES
    assert parse_dtype("fp8") == (torch.bfloat16, True)
    assert parse_dtype("float32") == (torch.float32, False)
    with pytest.raises(ModelError, match="dtype"):
        parse_dtype("int4")


def test_projection_shapes_of_qwen3_8b_by_hand():
    # hidden 4096, 32 q / 8 kv heads of 128, intermediate 12288
    shapes = projection_shapes(resolve_target("qwen3-8b"))
    assert shapes == {"wqkv": (6144, 4096), "wo": (4096, 4096), "w13": (24576, 4096), "w2": (4096, 12288)}
    args = resolve_target("qwen3-8b")
    assert projection_outputs(args) == 6144 + 4096 + 24576 + 4096
    assert projection_params(args) == 4096 * (6144 + 4096 + 24576) + 12288 * 4096
