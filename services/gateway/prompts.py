"""Prompts and the model's tokenizer: a chat through the model's chat template, a prompt's
size in bytes checked before anything tokenizes it, a completion's prompt as the client
gets it back (``echo``, token ids), and the work of ``/tokenize`` and ``/detokenize``.

``Prompts`` holds the tokenizer (None until ``load``) and the one thread that uses it: a
Hugging Face tokenizer must not be used from two threads at once, and a long chat takes a
while to template, so every use runs on that thread (``chat-template``), never on the event
loop, which serves everyone. ``close`` stops the thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from dataclasses import dataclass

from kvpush.services.gateway.requests import OpenAiRequest, TokenizeRequest
from kvpush.shared.errors import InvalidField, PromptTooLong


@dataclass
class Prompt:
    """The prompt as the client sees it again: its text (empty when the client asked for
    token ids: vLLM's choice), its token ids, and the first token's text (which has no
    logprob, so no decoded form from the engine)."""

    text: str
    token_ids: list[int]
    first_token: str


class Prompts:
    """The tokenizer of ``model`` and its thread. ``max_model_len``: the context the engines
    serve, which bounds a prompt's bytes (``max_prompt_bytes``, set by ``load``)."""

    def __init__(self, model: str, served_model_name: str, max_model_len: int):
        self.model = model
        self.served_model_name = served_model_name
        self.max_model_len = max_model_len
        self.max_prompt_bytes = 0  # set by load, from the tokenizer
        self.tokenizer = None
        # A Hugging Face tokenizer must not be used from two threads at once: one thread.
        self._templating = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="chat-template")

    async def load(self) -> None:
        """The model's tokenizer, and the most bytes a prompt that fits the context can hold."""
        from transformers import AutoTokenizer

        loop = asyncio.get_running_loop()
        self.tokenizer = await loop.run_in_executor(self._templating, AutoTokenizer.from_pretrained, self.model)
        self.max_prompt_bytes = await loop.run_in_executor(self._templating, prompt_byte_limit, self.tokenizer,
                                                           self.max_model_len)

    def close(self) -> None:
        self._templating.shutdown(wait=False, cancel_futures=True)

    def check_size(self, request: OpenAiRequest) -> None:
        """Refuse, before anything tokenizes it, a prompt too long in bytes to fit the context."""
        size = prompt_bytes(request)
        if size > self.max_prompt_bytes:
            raise PromptTooLong(f"the prompt is {size} bytes: more than {self.max_model_len} tokens of this model "
                                f"can hold (at most {self.max_prompt_bytes} bytes), so it cannot fit the context; "
                                "send a shorter prompt")

    async def apply_chat_template(self, request: OpenAiRequest) -> None:
        """Chat: the messages through the model's chat template, as token ids (on the
        template thread: a long chat takes a while, and the event loop serves everyone)."""
        if request.messages is None:
            return
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidField(f"the model '{self.served_model_name}' has no chat template; use /v1/completions")
        request.generate["prompt_token_ids"] = await asyncio.get_running_loop().run_in_executor(
            self._templating, chat_prompt, self.tokenizer, request.messages, request.tools)

    async def prompt_seen(self, request: OpenAiRequest) -> Prompt | None:
        """A completion's prompt as the client gets it back (``echo``, token ids), tokenized
        as the scheduler tokenizes it; None when the response shows no prompt."""
        if request.kind != "completion" or not (request.echo or request.return_token_ids):
            return None
        text = request.generate.get("prompt")

        def run() -> Prompt:
            ids = list(self.tokenizer.encode(text)) if text is not None else list(request.generate["prompt_token_ids"])
            shown = "" if request.return_token_ids else (text if text is not None else self.tokenizer.decode(ids))
            return Prompt(shown, ids, self.tokenizer.decode(ids[:1]))

        return await asyncio.get_running_loop().run_in_executor(self._templating, run)

    async def tokenize(self, request: TokenizeRequest) -> list[int]:
        """``/tokenize``, as the engines tokenize: the model's own tokenizer (and chat template)."""
        if request.messages is not None and not getattr(self.tokenizer, "chat_template", None):
            raise InvalidField(f"the model '{self.served_model_name}' has no chat template")
        text_size = len(request.prompt.encode()) if request.prompt is not None else \
            sum(len(m["content"].encode()) for m in request.messages or [])
        if text_size > self.max_prompt_bytes:
            raise PromptTooLong(f"the text is {text_size} bytes: more than {self.max_model_len} tokens of this "
                                f"model can hold (at most {self.max_prompt_bytes} bytes)")

        def run() -> list[int]:
            if request.messages is not None:
                return list(self.tokenizer.apply_chat_template(
                    request.messages, add_generation_prompt=request.add_generation_prompt, tokenize=True,
                    return_dict=False))
            return list(self.tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens))

        return await asyncio.get_running_loop().run_in_executor(self._templating, run)

    async def detokenize(self, token_ids: list[int]) -> str:
        return await asyncio.get_running_loop().run_in_executor(self._templating, self.tokenizer.decode, token_ids)


def prompt_bytes(request: OpenAiRequest) -> int:
    """The prompt's text in UTF-8 bytes (0 for token ids): what is measured before
    anything tokenizes it."""
    if request.messages is not None:
        return sum(len(m["role"].encode()) + len(m["content"].encode()) for m in request.messages)
    prompt = request.generate.get("prompt")
    return len(prompt.encode()) if isinstance(prompt, str) else 0


def prompt_byte_limit(tokenizer, max_model_len: int) -> int:
    """The most bytes a prompt of ``max_model_len`` tokens can hold. A token stands for at
    most as many bytes as its longest vocabulary entry's UTF-8 (a byte-level or
    sentencepiece entry is never shorter than the bytes it stands for); a tokenizer that
    normalizes text first (NFC, NFKC, lowercasing) may shrink it, by at most 3x."""
    longest = max((len(token.encode()) for token in tokenizer.get_vocab()), default=1)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    shrinks = backend is None or backend.normalizer is not None
    return max_model_len * longest * (4 if shrinks else 1)


def chat_prompt(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """The conversation's token ids, as vLLM's chat endpoint makes them: the model's chat
    template with the generation prompt (and the tools, which it shows the model)."""
    return list(tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                              return_dict=False))
