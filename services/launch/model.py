"""Build a small, deterministic Hugging Face model folder fully offline.

The folder holds a Qwen2 causal LM with random (but seeded) weights and a
byte-level BPE tokenizer trained on Python standard-library sources. Both
vLLM (CPU build) and transformers can load it. Nothing is downloaded.

The build is idempotent: a folder that already holds a complete build for the
same profile and seed is returned untouched, so callers can invoke
:func:`build_model` on every start.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sysconfig
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = [
    "EOS_TOKEN",
    "MARKER_NAME",
    "ModelProfile",
    "PROFILES",
    "build_model",
    "default_model_dir",
    "read_marker",
]

#: Bump when the recipe changes in a way that changes the produced files; a
#: folder built by another recipe version is rebuilt.
#: 2: the tokenizer has a chat template; 3: config.json names the profile's architecture;
#: 4: the chat template has a tool-call format (Hermes-style, vLLM's ``hermes`` parser).
BUILD_VERSION = 4

MARKER_NAME = "kvpush_model.json"
EOS_TOKEN = "<|endoftext|>"

#: Number of top-level stdlib ``.py`` files (sorted by name) used to train the
#: tokenizer. Top-level modules are ordinary source code (the ``encodings``
#: package, which a recursive listing reaches early, is mostly byte tables).
TOKENIZER_CORPUS_FILES = 300

#: Standard deviation used to re-initialise every 2-D weight. With the
#: transformers default (0.02) the model emits one token over and over; 0.1
#: makes the continuation depend on the whole context.
INIT_STD = 0.1

ROPE_THETA = 10000.0

#: Files (besides the marker) that make up a complete build.
_BUILD_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",  # what transformers loads as the tokenizer's chat_template
)


@dataclass(frozen=True)
class ModelProfile:
    """Shape of a Qwen2 model to build."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    #: What vLLM loads it as. A timed profile names the emulated-GPU model
    #: (tools/emulation), which paces each forward to the time ``emulates`` (a deployment in
    #: tools/emulation/catalog.py) would take; the network itself is this Qwen2.
    architecture: str = "Qwen2ForCausalLM"
    emulates: str | None = None

    @property
    def kv_bytes_per_token_fp32(self) -> int:
        """Bytes of K and V cache per token, all layers, in float32."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4


PROFILES: dict[str, ModelProfile] = {
    "small": ModelProfile(
        hidden_size=256,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        intermediate_size=512,
        vocab_size=4096,
        max_position_embeddings=8192,  # room for 4k-8k token benchmarks
    ),
    "kv-heavy": ModelProfile(
        hidden_size=512,
        num_layers=4,
        num_heads=4,
        num_kv_heads=4,
        head_dim=128,
        intermediate_size=1024,
        vocab_size=4096,
        # A 16k prompt and its outputs. Memory would allow far more (16 KiB of KV per token:
        # the bench's 2 GiB per engine hold 131,072 tokens); time does not (docs/benchmarks.md).
        max_position_embeddings=20480,
    ),
    # Emulated GPUs (docs/benchmarks.md, "Emulated GPUs"): the named model's layer count at the
    # narrowest width vLLM's CPU attention takes (head_dim 32, one KV head: 16 KiB of KV per
    # token in float32), and context for a 16k prompt plus its outputs.
    "timed-qwen3-32b": ModelProfile(
        hidden_size=64,
        num_layers=64,
        num_heads=1,
        num_kv_heads=1,
        head_dim=32,
        intermediate_size=128,
        vocab_size=4096,
        max_position_embeddings=20480,
        architecture="KvpushTimedForCausalLM",
        emulates="qwen3-32b@p5en",
    ),
    "timed-llama-3.1-8b": ModelProfile(
        hidden_size=64,
        num_layers=32,
        num_heads=1,
        num_kv_heads=1,
        head_dim=32,
        intermediate_size=128,
        vocab_size=4096,
        max_position_embeddings=20480,
        architecture="KvpushTimedForCausalLM",
        emulates="llama-3.1-8b@h100",
    ),
}

DEFAULT_PROFILE = "small"


def default_model_dir(profile: str = DEFAULT_PROFILE) -> Path:
    """``$KVPUSH_CACHE_DIR`` (or ``~/.cache/kvpush``) ``/models/<profile>``."""
    _get_profile(profile)
    base = os.environ.get("KVPUSH_CACHE_DIR")
    root = Path(base).expanduser() if base else Path.home() / ".cache" / "kvpush"
    return root / "models" / profile


def read_marker(out_dir: Path) -> dict | None:
    """The build marker of ``out_dir`` as a dict, or None if absent/unreadable."""
    try:
        with open(Path(out_dir) / MARKER_NAME, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def build_model(
    out_dir: Path,
    profile: str = DEFAULT_PROFILE,
    seed: int = 0,
    force: bool = False,
) -> Path:
    """Build (or reuse) the model folder ``out_dir`` and return its path.

    If ``out_dir`` already holds a complete build with the same profile, seed
    and recipe version and ``force`` is False, nothing is touched. Otherwise
    the model is built in a temporary sibling folder and moved into
    ``out_dir`` file by file; the marker is written last, so an interrupted
    build is never mistaken for a complete one. Files in ``out_dir`` that are
    not part of a build are left alone.
    """
    prof = _get_profile(profile)
    out_dir = Path(out_dir).expanduser().resolve()
    if not force and _is_complete(out_dir, profile, prof, seed):
        return out_dir

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.build-", dir=out_dir.parent))
    try:
        _build_into(tmp, profile, prof, seed)
        out_dir.mkdir(parents=True, exist_ok=True)
        # Invalidate first: from here until the new marker lands, the folder
        # does not count as complete.
        (out_dir / MARKER_NAME).unlink(missing_ok=True)
        for name in _BUILD_FILES:
            os.replace(tmp / name, out_dir / name)
        os.replace(tmp / MARKER_NAME, out_dir / MARKER_NAME)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


# --------------------------------------------------------------------------
# internals


def _get_profile(profile: str) -> ModelProfile:
    try:
        return PROFILES[profile]
    except KeyError:
        known = ", ".join(sorted(PROFILES))
        raise ValueError(f"unknown model profile {profile!r} (known: {known})") from None


def _is_complete(out_dir: Path, name: str, prof: ModelProfile, seed: int) -> bool:
    marker = read_marker(out_dir)
    if marker is None:
        return False
    if (
        marker.get("build_version") != BUILD_VERSION
        or marker.get("profile") != name
        or marker.get("seed") != seed
        or marker.get("profile_params") != asdict(prof)
    ):
        return False
    sizes = marker.get("file_sizes")
    if not isinstance(sizes, dict):
        return False
    for fname in _BUILD_FILES:
        try:
            if (out_dir / fname).stat().st_size != sizes.get(fname):
                return False
        except OSError:
            return False
    return True


def _corpus_files() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if p.is_file())
    files = files[:TOKENIZER_CORPUS_FILES]
    if not files:
        raise RuntimeError(f"no Python sources found in stdlib folder {stdlib}")
    return files


def _corpus_texts(files: list[Path]):
    for path in files:
        yield path.read_bytes().decode("utf-8", errors="replace")


def _train_tokenizer(prof: ModelProfile):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=prof.vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    files = _corpus_files()
    tok.train_from_iterator(_corpus_texts(files), trainer=trainer, length=len(files))
    if tok.get_vocab_size() != prof.vocab_size:
        # Padding the vocabulary would need invented tokens; the corpus is
        # large enough that this does not happen for the shipped profiles.
        raise RuntimeError(
            f"tokenizer vocabulary has {tok.get_vocab_size()} entries, "
            f"expected {prof.vocab_size}"
        )
    return tok, len(files)


# Plain text: the vocabulary has no special tokens but EOS. Enough for /v1/chat/completions
# to render a conversation the way any chat model's template does.
#: ``role: content`` lines. With ``tools``: a system line that lists them and says how to call
#: one, Hermes-style (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, what vLLM's
#: ``hermes`` tool parser reads); an assistant turn's calls and a tool's answer in that format.
#: A chat without tools renders exactly as build version 3 rendered it.
CHAT_TEMPLATE = (
    "{% if tools %}system: You may call these functions. To call one, reply with "
    "<tool_call>{\"name\": <its name>, \"arguments\": <an object of its parameters>}</tool_call>.\n<tools>"
    "{% for tool in tools %}{% set function = tool['function'] if tool['function'] is defined else tool %}"
    "{\"name\": {{ function['name'] | tojson }}, \"description\": {{ (function['description'] or '') | tojson }}, "
    "\"parameters\": {{ (function['parameters'] or {}) | tojson }}}\n{% endfor %}</tools>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' and message['tool_calls'] %}assistant: {{ message['content'] or '' }}"
    "{% for call in message['tool_calls'] %}{% set function = call['function'] %}"
    "<tool_call>{\"name\": {{ function['name'] | tojson }}, \"arguments\": "
    "{{ function['arguments'] if function['arguments'] is string else function['arguments'] | tojson }}}</tool_call>"
    "{% endfor %}{{ '\\n' }}"  # a literal newline right after a tag would be trimmed (trim_blocks)
    "{% elif message['role'] == 'tool' %}tool: <tool_response>{{ message['content'] }}</tool_response>\n"
    "{% else %}{{ message['role'] }}: {{ message['content'] }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _build_into(tmp: Path, name: str, prof: ModelProfile, seed: int) -> None:
    raw_tok, n_files = _train_tokenizer(prof)
    eos_id = raw_tok.token_to_id(EOS_TOKEN)
    _save_tokenizer(tmp, raw_tok, prof)
    model = _random_model(_qwen2_config(prof, eos_id), eos_id, seed)
    with _quiet_transformers():
        model.save_pretrained(str(tmp), safe_serialization=True)
    _name_architecture(tmp / "config.json", prof.architecture)
    _keep_build_files_only(tmp)

    marker = {
        "build_version": BUILD_VERSION,
        "profile": name,
        "profile_params": asdict(prof),
        "seed": seed,
        "weights_sha256": _weights_hash(model.state_dict()),
        "tokenizer_sha256": _file_sha256(tmp / "tokenizer.json"),
        "tokenizer_corpus_files": n_files,
        "eos_token_id": eos_id,
        "file_sizes": {f: (tmp / f).stat().st_size for f in _BUILD_FILES},
    }
    (tmp / MARKER_NAME).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _name_architecture(config_path: Path, architecture: str) -> None:
    """save_pretrained names the class that saved the weights (transformers' Qwen2); vLLM
    loads the profile's architecture, the same network under another name for a timed one."""
    config = json.loads(config_path.read_text(encoding="utf-8"))
    if config.get("architectures") != [architecture]:
        config["architectures"] = [architecture]
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _save_tokenizer(tmp: Path, raw_tok, prof: ModelProfile) -> None:
    from transformers import PreTrainedTokenizerFast

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=raw_tok,
        eos_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        model_max_length=prof.max_position_embeddings,
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )
    with _quiet_transformers():
        hf_tok.save_pretrained(str(tmp))
    (tmp / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")  # whatever this version wrote


def _qwen2_config(prof: ModelProfile, eos_id: int):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=prof.vocab_size,
        hidden_size=prof.hidden_size,
        intermediate_size=prof.intermediate_size,
        num_hidden_layers=prof.num_layers,
        num_attention_heads=prof.num_heads,
        num_key_value_heads=prof.num_kv_heads,
        head_dim=prof.head_dim,
        max_position_embeddings=prof.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        tie_word_embeddings=False,
        use_sliding_window=False,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        dtype="float32",
        architectures=[prof.architecture],
        **({"kvpush_emulation": {"target": prof.emulates}} if prof.emulates else {}),
    )


def _random_model(config, eos_id: int, seed: int):
    import torch
    from transformers import GenerationConfig, Qwen2ForCausalLM

    # Leave the caller's global RNG state as it was.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch.float32)
    # Every 2-D weight (embeddings, projections, lm_head) is drawn from a
    # dedicated generator in name order, so the result does not depend on
    # how transformers initialises (or lazily skips initialising) weights.
    # 1-D parameters keep their constant defaults (norm weights 1, biases 0).
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for _pname, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if param.dim() == 2:
                param.normal_(mean=0.0, std=INIT_STD, generator=gen)
    model.eval()

    model.generation_config = GenerationConfig(
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        do_sample=False,
    )
    return model


def _keep_build_files_only(tmp: Path) -> None:
    missing = [f for f in _BUILD_FILES if not (tmp / f).is_file()]
    if missing:
        raise RuntimeError(f"model build did not produce {missing}")
    # Remove anything save_pretrained wrote that is not part of the build
    # (e.g. special_tokens_map.json on some versions) so the folder content
    # stays exactly the listed files plus the marker.
    for extra in tmp.iterdir():
        if extra.name not in _BUILD_FILES:
            if extra.is_dir():
                shutil.rmtree(extra)
            else:
                extra.unlink()

    # safetensors writes its file owner-only (0600); make the folder readable
    # like any other cache (other users/containers may serve from it).
    for fname in _BUILD_FILES:
        os.chmod(tmp / fname, 0o644)


@contextlib.contextmanager
def _quiet_transformers():
    """Silence transformers' progress bars and info logging for a moment."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    verbosity = hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _weights_hash(state_dict) -> str:
    import torch

    h = hashlib.sha256()
    for key in sorted(state_dict):
        t = state_dict[key].detach().contiguous().cpu()
        h.update(key.encode())
        h.update(str(t.dtype).encode())
        h.update(repr(tuple(t.shape)).encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
