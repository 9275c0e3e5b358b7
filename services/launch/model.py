"""Build a small, deterministic Hugging Face model folder fully offline.

The folder holds a Qwen2 causal LM with random (but seeded) weights and a
byte-level BPE tokenizer trained on Python standard-library sources. Both
vLLM (CPU build) and transformers can load it. Nothing is downloaded. The
shapes are in ``profiles``, the tokenizer in ``tokenizer``, the network and
its weights in ``weights``; this module builds the folder from them.

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
import tempfile
from dataclasses import asdict
from pathlib import Path

from kvpush.services.launch.profiles import DEFAULT_PROFILE, PROFILES, ModelProfile, get_profile
from kvpush.services.launch.tokenizer import CHAT_TEMPLATE, EOS_TOKEN, train_tokenizer
from kvpush.services.launch.weights import qwen2_config, random_model, weights_hash

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

#: Files (besides the marker) that make up a complete build.
_BUILD_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",  # what transformers loads as the tokenizer's chat_template
)


def default_model_dir(profile: str = DEFAULT_PROFILE) -> Path:
    """``$KVPUSH_CACHE_DIR`` (or ``~/.cache/kvpush``) ``/models/<profile>``."""
    get_profile(profile)
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
    prof = get_profile(profile)
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


def _build_into(tmp: Path, name: str, prof: ModelProfile, seed: int) -> None:
    raw_tok, n_files = train_tokenizer(prof.vocab_size)
    eos_id = raw_tok.token_to_id(EOS_TOKEN)
    _save_tokenizer(tmp, raw_tok, prof)
    model = random_model(qwen2_config(prof, eos_id), eos_id, seed)
    with _quiet_transformers():
        model.save_pretrained(str(tmp), safe_serialization=True)
    _name_architecture(tmp / "config.json", prof.architecture)
    _keep_build_files_only(tmp)

    marker = {
        "build_version": BUILD_VERSION,
        "profile": name,
        "profile_params": asdict(prof),
        "seed": seed,
        "weights_sha256": weights_hash(model.state_dict()),
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


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
