import dataclasses
import json
import os
from pathlib import Path

import pytest

from kvpush.services.launch.model import (
    EOS_TOKEN,
    MARKER_NAME,
    PROFILES,
    ModelProfile,
    build_model,
    default_model_dir,
    read_marker,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _mtimes(d: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in sorted(d.iterdir())}


@pytest.fixture(scope="module")
def small_model(tmp_path_factory) -> Path:
    return build_model(tmp_path_factory.mktemp("model") / "small", profile="small", seed=0)


@pytest.fixture(scope="module")
def loaded(small_model):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(small_model), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(small_model), local_files_only=True)
    model.eval()
    assert model.dtype == torch.float32
    return tok, model


def _greedy(model, ids: list[int], n: int = 8) -> list[int]:
    import torch

    inp = torch.tensor([ids], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(
            inp,
            attention_mask=torch.ones_like(inp),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
        )
    return out[0, len(ids):].tolist()


def test_profiles():
    small = PROFILES["small"]
    assert isinstance(small, ModelProfile)
    assert (small.hidden_size, small.num_layers, small.num_heads, small.num_kv_heads) == (256, 2, 4, 2)
    assert small.head_dim == 64 and small.vocab_size == 4096
    heavy = PROFILES["kv-heavy"]
    # 4 layers x (K+V) x 4 heads x 128 x 4 bytes
    assert heavy.kv_bytes_per_token_fp32 == 16 * 1024
    with pytest.raises(dataclasses.FrozenInstanceError):
        small.hidden_size = 1


def test_default_model_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("KVPUSH_CACHE_DIR", str(tmp_path))
    assert default_model_dir() == tmp_path / "models" / "small"
    assert default_model_dir("kv-heavy") == tmp_path / "models" / "kv-heavy"
    monkeypatch.delenv("KVPUSH_CACHE_DIR")
    assert default_model_dir() == Path.home() / ".cache" / "kvpush" / "models" / "small"
    with pytest.raises(ValueError, match="unknown model profile 'nope'"):
        default_model_dir("nope")


def test_unknown_profile(tmp_path):
    with pytest.raises(ValueError, match="unknown model profile 'nope'"):
        build_model(tmp_path / "m", profile="nope")
    assert not (tmp_path / "m").exists()


def test_folder_contents(small_model):
    names = {p.name for p in small_model.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        MARKER_NAME,
    } == names
    cfg = json.loads((small_model / "config.json").read_text())
    assert cfg["model_type"] == "qwen2"
    from transformers import AutoTokenizer

    chat = AutoTokenizer.from_pretrained(str(small_model)).apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "user: hi\nassistant:"
    assert cfg["head_dim"] == 64
    assert cfg["num_key_value_heads"] == 2
    assert cfg["tie_word_embeddings"] is False
    marker = read_marker(small_model)
    assert marker["profile"] == "small" and marker["seed"] == 0
    assert len(marker["weights_sha256"]) == 64
    assert cfg["eos_token_id"] == cfg["bos_token_id"] == marker["eos_token_id"]


def test_deterministic(tmp_path, small_model):
    import torch

    torch.manual_seed(1234)
    rng_before = torch.get_rng_state()
    other = build_model(tmp_path / "again", profile="small", seed=0)
    # The caller's global RNG state is left untouched.
    assert torch.equal(torch.get_rng_state(), rng_before)
    a, b = read_marker(small_model), read_marker(other)
    assert a["weights_sha256"] == b["weights_sha256"]
    assert a["tokenizer_sha256"] == b["tokenizer_sha256"]
    assert (small_model / "tokenizer.json").read_bytes() == (other / "tokenizer.json").read_bytes()
    assert (small_model / "model.safetensors").read_bytes() == (other / "model.safetensors").read_bytes()


def test_seed_changes_weights(tmp_path, small_model):
    other = build_model(tmp_path / "seed1", profile="small", seed=1)
    assert read_marker(other)["weights_sha256"] != read_marker(small_model)["weights_sha256"]
    # The tokenizer does not depend on the seed.
    assert (small_model / "tokenizer.json").read_bytes() == (other / "tokenizer.json").read_bytes()


def test_idempotent_and_force(tmp_path):
    d = tmp_path / "m"
    build_model(d)
    before = _mtimes(d)
    assert build_model(d) == d.resolve()
    assert _mtimes(d) == before  # nothing rewritten

    # A different seed in the same folder rebuilds it.
    build_model(d, seed=3)
    assert read_marker(d)["seed"] == 3
    after_seed = _mtimes(d)
    assert after_seed != before

    # force rebuilds even when complete.
    build_model(d, seed=3, force=True)
    assert _mtimes(d)[MARKER_NAME] != after_seed[MARKER_NAME]

    # A folder missing a file (interrupted copy) is not complete.
    (d / "model.safetensors").unlink()
    build_model(d, seed=3)
    assert (d / "model.safetensors").is_file()

    # Unrelated files are left alone; no temporary folders are left behind.
    (d / "notes.txt").write_text("keep")
    build_model(d, seed=4)
    assert (d / "notes.txt").read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


TEXTS = [
    "def foo(x):\n    return {'a': x ** 2}  # héllo ✓ 漢字\n\t\r\n",
    "import os\n\ndef main(argv):\n    for name in sorted(os.listdir('.')):\n        print(name)\n",
    "x = 12345 + 0.5e-3\n",
    "  leading spaces and trailing ones  ",
    "a" + EOS_TOKEN + "b",
    "😀 ünïcödé",
]


def test_tokenizer_round_trip(loaded, small_model):
    """What vLLM loads from the folder (transformers' AutoTokenizer) agrees with the folder's
    own files, tokenizer.json, config.json and the build marker, and is lossless."""
    from tokenizers import Tokenizer

    tok, model = loaded
    raw = Tokenizer.from_file(str(small_model / "tokenizer.json"))
    cfg = json.loads((small_model / "config.json").read_text())
    eos_id = read_marker(small_model)["eos_token_id"]
    assert cfg["eos_token_id"] == cfg["bos_token_id"] == cfg["pad_token_id"] == eos_id
    assert raw.token_to_id(EOS_TOKEN) == eos_id
    assert tok.eos_token == tok.bos_token == tok.pad_token == EOS_TOKEN
    assert (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id) == (eos_id, eos_id, eos_id)
    assert len(tok) == raw.get_vocab_size() == cfg["vocab_size"] == PROFILES["small"].vocab_size
    assert model.get_input_embeddings().num_embeddings == cfg["vocab_size"]
    assert tok.model_max_length == cfg["max_position_embeddings"] == PROFILES["small"].max_position_embeddings
    assert tok.get_vocab() == raw.get_vocab()
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert all(0 <= i < cfg["vocab_size"] for i in ids)
        assert tok.decode(ids) == text
        assert raw.decode(raw.encode(text, add_special_tokens=False).ids, skip_special_tokens=False) == text
    assert tok.encode(EOS_TOKEN, add_special_tokens=False) == raw.encode(EOS_TOKEN).ids == [eos_id]
    # Code is compressed well below one token per byte.
    assert len(tok.encode(TEXTS[1], add_special_tokens=False)) < len(TEXTS[1].encode()) / 2


def test_the_scheduler_tokenizes_text_like_the_engine(loaded, small_model):
    """A text prompt becomes the ids vLLM would make of it: the scheduler's tokenizer
    (``load_validator``) against the one vLLM loads from the same folder (AutoTokenizer)."""
    from kvpush.services.scheduler.validation import load_validator

    tok, _ = loaded
    scheduler = load_validator(str(small_model), PROFILES["small"].max_position_embeddings)
    assert scheduler.vocab_size == len(tok)
    assert {text: scheduler.tokenize(text) for text in TEXTS} == {
        text: tok.encode(text) for text in TEXTS}  # vLLM's default: add_special_tokens=True


def test_generation_depends_on_context(loaded):
    tok, model = loaded
    p1 = tok.encode("def foo(x):\n    return", add_special_tokens=False)
    p2 = tok.encode("class Bar(object):\n    pass", add_special_tokens=False)
    out1, out2 = _greedy(model, p1), _greedy(model, p2)
    assert len(out1) == len(out2) == 8
    assert out1 != out2
    # Not a single repeated token.
    assert len(set(out1)) > 1

    # Changing only the first token of a longer prompt changes the continuation.
    long = tok.encode(
        "import sys\nimport os\n\ndef main(argv):\n    path = argv[1]\n    with open(path) as f:\n",
        add_special_tokens=False,
    )
    assert len(long) > 10
    changed = [(long[0] + 1) % len(tok)] + long[1:]
    assert _greedy(model, long) != _greedy(model, changed)
    # Greedy decoding is reproducible.
    assert _greedy(model, long) == _greedy(model, long)


def test_the_kv_heavy_model_holds_the_benchs_longest_prompt_and_its_outputs():
    """kvpush bench's 16k workload (``--workloads 16k``) runs on the kv-heavy model: the
    prompt, 128 output tokens and nothing cut."""
    from kvpush.tools.bench.run import LONG

    longest = max(w.longest for w in LONG)
    assert longest >= 16384
    assert PROFILES["kv-heavy"].max_position_embeddings >= longest + 128
