"""The built-in model's tokenizer: byte-level BPE trained on Python standard-library
sources, and its chat template. Deterministic for a given Python (the corpus is that
Python's standard library); nothing is downloaded. ``kvpush.services.launch.model``
builds the model folder with it.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

EOS_TOKEN = "<|endoftext|>"

#: Number of top-level stdlib ``.py`` files (sorted by name) used to train the
#: tokenizer. Top-level modules are ordinary source code (the ``encodings``
#: package, which a recursive listing reaches early, is mostly byte tables).
TOKENIZER_CORPUS_FILES = 300


def corpus_files() -> list[Path]:
    """The training corpus: the first ``TOKENIZER_CORPUS_FILES`` top-level sources of this
    Python's standard library, by name."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if p.is_file())
    files = files[:TOKENIZER_CORPUS_FILES]
    if not files:
        raise RuntimeError(f"no Python sources found in stdlib folder {stdlib}")
    return files


def _corpus_texts(files: list[Path]):
    for path in files:
        yield path.read_bytes().decode("utf-8", errors="replace")


def train_tokenizer(vocab_size: int):
    """(a ``tokenizers.Tokenizer`` of exactly ``vocab_size`` entries, EOS its only special
    token; the number of corpus files it was trained on)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    files = corpus_files()
    tok.train_from_iterator(_corpus_texts(files), trainer=trainer, length=len(files))
    if tok.get_vocab_size() != vocab_size:
        # Padding the vocabulary would need invented tokens; the corpus is
        # large enough that this does not happen for the shipped profiles.
        raise RuntimeError(
            f"tokenizer vocabulary has {tok.get_vocab_size()} entries, "
            f"expected {vocab_size}"
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
