import json

import pytest
import torch

from spectune.errors import SpectuneError
from spectune.models.config import (
    PRESETS,
    DrafterSpec,
    ModelArgs,
    ModelError,
    from_hf_dir,
    kv_bytes_per_token,
    param_count,
    parse_drafter,
    resolve_target,
    weight_bytes,
)

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
