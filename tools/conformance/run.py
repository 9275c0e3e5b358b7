"""Send every row of the table to a single ``vllm serve`` and to kvpush's gateway in each
transfer mode, one request at a time, and compare (``compare``). Each (row, mode) pair gets
a prompt of its own, sent to both systems, so neither meets a prefix of another request in
its cache."""

from __future__ import annotations

import json
import uuid
from dataclasses import asdict, dataclass
from typing import Literal

import httpx

from kvpush.tools.conformance import compare
from kvpush.tools.conformance.table import MODES, ROWS, Row

# "vllm fails": the reference answered 5xx (or broke its stream with an error event) where
# kvpush answered: nothing to compare, and not counted against kvpush. "kvpush fails": the
# same of kvpush, which is.
Outcome = Literal["equal", "differs", "kvpush refuses", "vllm refuses", "both refuse", "vllm fails", "kvpush fails"]
TIMEOUT_S = 120.0


@dataclass
class Result:
    field: str
    endpoint: str
    mode: str
    outcome: Outcome
    detail: str = ""


@dataclass
class Reply:
    status: int
    body: dict  # the answer (streamed ones gathered), or the error object


def request_body(row: Row, model: str, salt: str) -> dict:
    # Token ids unless the row says otherwise (an echo's text: vLLM echoes no text with them).
    body = {"model": model, "return_token_ids": True, **{k: v for k, v in row.body.items() if v is not None}}
    text = f"{salt} {row.text}"
    if row.endpoint == "completions":
        body["prompt"] = text
    else:
        body["messages"] = [{"role": "user", "content": text}, *row.after]
    return body


async def send(client: httpx.AsyncClient, base_url: str, row: Row, body: dict) -> Reply:
    path = "/v1/completions" if row.endpoint == "completions" else "/v1/chat/completions"
    if not body.get("stream"):
        response = await client.post(base_url + path, json=body, timeout=TIMEOUT_S)
        return Reply(response.status_code, _json(response.text))
    events = []
    async with client.stream("POST", base_url + path, json=body, timeout=TIMEOUT_S) as response:
        if response.status_code != 200:
            return Reply(response.status_code, _json((await response.aread()).decode()))
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line[6:].strip() != "[DONE]":
                event = json.loads(line[6:])
                if isinstance(event.get("error"), dict):  # the stream broke off with an error event
                    code = event["error"].get("code")
                    return Reply(code if isinstance(code, int) and code >= 400 else 500, event)
                events.append(event)
    return Reply(200, compare.gather(row.endpoint, events))


def _json(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError:
        return {"error": {"message": text[:300]}}
    return value if isinstance(value, dict) else {"error": {"message": text[:300]}}


def _error(reply: Reply) -> str:
    error = reply.body.get("error")
    message = error.get("message") if isinstance(error, dict) else (error or reply.body.get("message"))
    return f"{reply.status}: {str(message)[:200]}"


def judge(row: Row, mode: str, reference: Reply, kvpush: Reply) -> Result:
    result = Result(row.field, row.endpoint, mode, "equal")
    if kvpush.status >= 500:
        result.outcome, result.detail = "kvpush fails", _error(kvpush)
    elif reference.status >= 500 and kvpush.status == 200:
        result.outcome, result.detail = "vllm fails", _error(reference)
    elif reference.status != 200 and kvpush.status != 200:
        result.outcome, result.detail = "both refuse", f"vLLM {_error(reference)}; kvpush {_error(kvpush)}"
    elif kvpush.status != 200:
        result.outcome, result.detail = "kvpush refuses", _error(kvpush)
    elif reference.status != 200:
        result.outcome, result.detail = "vllm refuses", _error(reference)
    else:
        found = compare.differences(compare.answer(row.endpoint, reference.body),
                                    compare.answer(row.endpoint, kvpush.body), compare_cached=row.compare_cached)
        if found:
            result.outcome, result.detail = "differs", "; ".join(found)[:400]
    return result


async def run(vllm_url: str, kvpush_url: str, rows: list[Row] = ROWS, modes: tuple[str, ...] = MODES) -> list[Result]:
    run_id = uuid.uuid4().hex[:8]
    results = []
    async with httpx.AsyncClient() as client:
        models = {}
        for url in (vllm_url, kvpush_url):
            models[url] = (await client.get(url + "/v1/models", timeout=30)).json()["data"][0]["id"]
        for index, row in enumerate(rows):
            for mode in modes:
                salt = f"conformance {run_id} {index} {mode}:"
                replies = []
                for url, extra in ((vllm_url, {}), (kvpush_url, {"transfer_mode": mode})):
                    body = {**request_body(row, models[url], salt), **extra}
                    reply = await send(client, url, row, body)
                    if row.repeat and reply.status == 200:
                        reply = await send(client, url, row, body)
                    replies.append(reply)
                results.append(judge(row, mode, *replies))
    return results


def table(results: list[Result]) -> str:
    """Markdown, one row per field, one column per mode."""
    modes = list(dict.fromkeys(r.mode for r in results))
    by_field: dict[tuple[str, str], dict[str, Result]] = {}
    for r in results:
        by_field.setdefault((r.field, r.endpoint), {})[r.mode] = r
    lines = ["| field | endpoint | " + " | ".join(modes) + " |", "|---|---|" + "---|" * len(modes)]
    for (name, endpoint), per_mode in by_field.items():
        cells = []
        for mode in modes:
            r = per_mode.get(mode)
            if r is None:
                cells.append("")
            elif r.outcome in ("equal", "both refuse"):
                cells.append(r.outcome)
            else:
                cells.append(f"**{r.outcome}**: {r.detail[:160]}".replace("|", "\\|").replace("\n", " "))
        lines.append(f"| `{name}` | {endpoint} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def as_json(results: list[Result]) -> list[dict]:
    return [asdict(r) for r in results]
