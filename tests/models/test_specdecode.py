import gzip
import importlib.util
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from spectune.models.smollm2 import (  # noqa: E402
    GGUF_ENV,
    EarlyExitDrafter,
    ModelLoadError,
    NgramDrafter,
    eos_ids,
    find_gguf,
    load_smollm2,
    shallow_view,
)
from spectune.models.specdecode import (  # noqa: E402
    TRACE_FIELDS,
    Draft,
    SpecResult,
    Step,
    TraceError,
    accept_prefix,
    first_mismatch,
    greedy_reference,
    read_traces,
    speculative_generate,
    summarize,
    trace_records,
    write_traces,
)
from spectune.models.suffix_drafter import SuffixDrafter  # noqa: E402

VOCAB = 64
EOS = 2


def tiny_llama(init: float = 0.02, seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=EOS, pad_token_id=EOS,
        initializer_range=init,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def random_prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [1, *torch.randint(2, 20, (n - 1,), generator=g).tolist()]
    return [torch.randint(3, VOCAB, (length,), generator=g).tolist() for length in lengths]


def make_drafter(which, model):
    if which == "ngram":
        return NgramDrafter()
    if which == "suffix":
        return SuffixDrafter(depth=8, max_match=4)
    return EarlyExitDrafter(model, layers=1)


@pytest.mark.parametrize("which, k", [("ngram", 0), ("ngram", 4), ("suffix", 4), ("self-spec", 4)])
def test_speculative_output_equals_greedy_generate(model, which, k):
    drafter = make_drafter(which, model)
    for prompt in random_prompts(3, seed=7):
        ref = greedy_reference(model, prompt, max_new_tokens=24, eos_token_id=EOS)
        res = speculative_generate(model, prompt, drafter, k=k, max_new_tokens=24, eos_token_id=EOS)
        assert res.tokens == ref, f"first mismatch at {first_mismatch(ref, res.tokens)}"
        emitted = [s.accepted + 1 for s in res.steps]
        # the last step may overshoot max_new_tokens or stop on eos; every earlier step is kept whole
        assert sum(emitted[:-1]) < len(res.tokens) <= sum(emitted)
        for s in res.steps:
            assert 0 <= s.accepted <= s.offered <= k
            if which == "self-spec":
                assert s.offered == k and s.conf is not None and len(s.conf) == k
                assert all(0.0 < c <= 1.0 for c in s.conf)
            elif which == "ngram":
                assert s.conf is None
            else:  # suffix: a conditional probability per offered draft
                assert s.conf is not None and len(s.conf) == s.offered and all(0.0 < c < 1.0 for c in s.conf)
        if which == "suffix":
            drafter.remember(res.tokens)  # later prompts also draft from this output


def test_every_drafter_accepts_and_rejects_somewhere(model):
    # the equality test above is only meaningful if drafts are both kept and thrown away
    for drafter in (NgramDrafter(), SuffixDrafter(depth=8, max_match=4), EarlyExitDrafter(model, layers=1)):
        steps = [s for p in random_prompts(3, seed=7)
                 for s in speculative_generate(model, p, drafter, k=4, max_new_tokens=24, eos_token_id=EOS).steps]
        assert any(s.accepted > 0 for s in steps), drafter.name
        assert any(s.accepted < s.offered for s in steps), drafter.name


def test_eos_stops_generation(model):
    prompt = random_prompts(3, seed=7)[1]
    free = greedy_reference(model, prompt, max_new_tokens=24, eos_token_id=None)
    eos = free[5]  # a token greedy decoding emits: treat it as end of sequence
    ref = greedy_reference(model, prompt, max_new_tokens=24, eos_token_id=eos)
    assert ref == free[: free.index(eos) + 1]
    for drafter in (NgramDrafter(), SuffixDrafter(depth=8, max_match=4), EarlyExitDrafter(model, layers=1)):
        res = speculative_generate(model, prompt, drafter, k=4, max_new_tokens=24, eos_token_id=[eos])
        assert res.tokens == ref


@pytest.mark.parametrize(
    "drafts, target, n",
    [
        ([5, 6, 7], [5, 6, 7, 8], 3),  # all accepted, 8 is the bonus token
        ([5, 9, 7], [5, 6, 7, 8], 1),  # mismatch at position 1
        ([9], [5, 6], 0),
        ([], [5], 0),  # nothing offered: plain decoding step
    ],
)
def test_accept_prefix(drafts, target, n):
    assert accept_prefix(drafts, target) == n


def test_ngram_drafter_longest_then_earliest_match():
    d = NgramDrafter()
    # last 3 tokens (1, 2, 3) first occur at 0 -> propose what followed them
    assert d.propose([1, 2, 3, 4, 5, 1, 2, 3], 3) == Draft((4, 5, 1), None)
    # no 3- or 2-gram match; 1-gram 9 first occurs at 1
    assert d.propose([8, 9, 4, 7, 9], 2) == Draft((4, 7), None)
    # the continuation may be shorter than k near the end of the context
    assert d.propose([7, 6, 7], 5) == Draft((6, 7), None)
    assert d.propose([1, 2, 3], 4) == Draft((), None)
    assert d.propose([4], 4) == Draft((), None)


def test_early_exit_drafter_cache_matches_recompute(model):
    drafter = EarlyExitDrafter(model, layers=2)
    view = shallow_view(model, 2)

    def naive(context, k):
        ctx, out = list(context), []
        with torch.no_grad():
            for _ in range(k):
                tok = int(view(input_ids=torch.tensor([ctx]), use_cache=False).logits[0, -1].argmax())
                ctx.append(tok)
                out.append(tok)
        return tuple(out)

    context = random_prompts(2, seed=3)[1]
    first = drafter.propose(context, 4)
    assert first.tokens == naive(context, 4)
    # two drafts accepted, then a different bonus token: the drafter must forget the rest
    drafter.rollback(len(context) + 2)
    context = [*context, *first.tokens[:2], (first.tokens[2] + 1) % VOCAB]
    assert drafter.propose(context, 4).tokens == naive(context, 4)


def test_shallow_view_shares_weights_and_checks_depth(model):
    view = shallow_view(model, 2)
    assert len(view.model.layers) == 2
    assert view.model.layers[1] is model.model.layers[1]
    assert view.lm_head.weight.data_ptr() == model.lm_head.weight.data_ptr()
    with pytest.raises(ModelLoadError, match="layers must be in 1..2"):
        shallow_view(model, 3)


def test_trace_lines_roundtrip(tmp_path):
    res = SpecResult(tokens=(5, 6, 7, 8, 9), steps=(
        Step(offered=3, accepted=2, conf=(0.9, 0.51234567, 0.1)),
        Step(offered=3, accepted=0, conf=(0.2, 0.3, 0.4)),
    ))
    recs = trace_records(res, request="mtbench-81", dataset="mtbench", drafter="self-spec-8l", model="M")
    assert list(recs[0]) == list(TRACE_FIELDS)
    assert [r["step"] for r in recs] == [0, 1]
    assert recs[0]["conf"] == [0.9, 0.5123, 0.1]
    no_conf = trace_records(SpecResult((1,), (Step(0, 0, None),)), request="humaneval-3",
                            dataset="humaneval", drafter="ngram", model="M")
    assert "conf" not in no_conf[0]

    path = tmp_path / "t.jsonl.gz"
    write_traces(path, recs + no_conf)
    with gzip.open(path, "rt") as fh:
        assert len(fh.read().splitlines()) == 3
    assert read_traces(path) == recs + no_conf
    assert not list(tmp_path.glob(".*tmp"))


@pytest.mark.parametrize(
    "change, match",
    [
        ({"accepted": 4}, "accepted: 4 exceeds offered 3"),
        ({"conf": [0.5]}, "conf: must be 3 numbers"),
        ({"offered": -1}, "offered: must be an integer"),
        ({"extra": 1}, "extra: unknown field"),
        ({"request": ""}, "request: must be a non-empty string"),
    ],
)
def test_read_traces_names_bad_field(tmp_path, change, match):
    rec = {"request": "mtbench-1", "step": 0, "offered": 3, "accepted": 1, "conf": [0.5, 0.4, 0.3],
           "dataset": "mtbench", "drafter": "ngram", "model": "M"}
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(rec) + "\n" + json.dumps(rec | change) + "\n")
    with pytest.raises(TraceError, match=f"bad.jsonl:2: {match}"):
        read_traces(path)
    del rec["step"]
    path.write_text(json.dumps(rec) + "\n")
    with pytest.raises(TraceError, match="bad.jsonl:1: step: missing"):
        read_traces(path)


def test_summarize_counts():
    recs = [{"request": "a", "offered": 3, "accepted": 3}, {"request": "a", "offered": 3, "accepted": 1},
            {"request": "b", "offered": 0, "accepted": 0}, {"request": "b", "offered": 2, "accepted": 2}]
    s = summarize(recs, k=3)
    assert s["requests"] == 2 and s["steps"] == 4 and s["steps_with_no_draft"] == 1
    assert s["mean_acceptance_length"] == 1 + 6 / 4
    assert s["mean_acceptance_length_full_k"] == 1 + 4 / 2
    assert s["per_position"] == [1.0, round(2 / 3, 4), 0.5]


def test_find_gguf_names_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv(GGUF_ENV, str(tmp_path / "nowhere.gguf"))
    with pytest.raises(ModelLoadError, match=f"nowhere.gguf.*{GGUF_ENV}"):
        find_gguf()
    f = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    f.write_bytes(b"")
    assert find_gguf(tmp_path) == f


def _have_gguf() -> bool:
    try:
        find_gguf()
        return True
    except ModelLoadError:
        return False


@pytest.mark.skipif(not _have_gguf(), reason=f"SmolLM2 GGUF absent (set ${GGUF_ENV})")
@pytest.mark.skipif(not all(importlib.util.find_spec(m) for m in ("gguf", "accelerate")),
                    reason="gguf/accelerate not installed")
def test_load_smollm2_from_gguf():
    model, tokenizer = load_smollm2()
    assert model.config.num_hidden_layers == 30
    assert eos_ids(model, tokenizer) == (2,)
    prompt = list(tokenizer("def add(a, b):\n    return").input_ids)
    ref = greedy_reference(model, prompt, max_new_tokens=8, eos_token_id=2)
    res = speculative_generate(model, prompt, EarlyExitDrafter(model, 8), k=3, max_new_tokens=8, eos_token_id=2)
    assert res.tokens == ref
