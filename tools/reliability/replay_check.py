"""What replaying a migrated request's sent tokens keeps, on one plain vLLM engine
(services/worker/replay.py): a seeded request replayed for its first k tokens goes on
exactly as uninterrupted (the generator advanced one draw a token), and a stop string that
spans the end of the replay is found where the uninterrupted request finds it. And the
replay is what decides: replaying tokens the request would not have sampled gives them.

    python -m kvpush.tools.reliability.replay_check

Prints one JSON object: how many cases of each, and how many held.
"""

from __future__ import annotations

import json

from kvpush.services.launch.model import build_model, default_model_dir
from kvpush.services.worker.engine import engine_kwargs
from kvpush.services.worker.engine_settings import EngineSettings
from kvpush.shared.wire import REPLAY_KEY

BREAKS = (1, 5, 15, 25)


def check(model: str) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(**engine_kwargs(EngineSettings(model=model, role=None, engine_id="replay-check", nats_url=None)))
    tokenizer = llm.get_tokenizer()

    def run(prompt: dict, **sampling):
        return llm.generate([prompt], [SamplingParams(max_tokens=40, ignore_eos=True, **sampling)],
                            use_tqdm=False)[0].outputs[0]

    seeded = seeded_held = stops = stops_held = forced_held = 0
    for p in range(6):
        prompt = {"prompt_token_ids": list(range(100 + p, 160 + p))}
        sampled = {"temperature": 0.8, "top_p": 0.9, "seed": 7 + p}
        whole = list(run(prompt, **sampled).token_ids)
        forced = list(run(prompt, **sampled, extra_args={REPLAY_KEY: [5] * 10}).token_ids)
        forced_held += forced[:10] == [5] * 10  # the replay decides the tokens, whatever was likely
        for k in BREAKS:
            seeded += 1
            seeded_held += list(run(prompt, **sampled, extra_args={REPLAY_KEY: whole[:k]}).token_ids) == whole
        greedy = list(run(prompt, temperature=0.0).token_ids)
        for k in BREAKS[1:]:
            # the text of tokens k-1 and k: a stop string across the break after k tokens
            before, through = tokenizer.decode(greedy[:k - 1]), tokenizer.decode(greedy[:k + 1])
            stop = through[len(before):]
            if len(stop.strip()) < 2 or stop in before:
                continue
            stops += 1
            replayed = run(prompt, temperature=0.0, stop=[stop], extra_args={REPLAY_KEY: greedy[:k]})
            uninterrupted = run(prompt, temperature=0.0, stop=[stop])
            stops_held += (replayed.finish_reason == "stop" and replayed.text == uninterrupted.text
                           and list(replayed.token_ids) == list(uninterrupted.token_ids))
    return {"forced": forced_held, "seeded": seeded, "seeded_exact": seeded_held, "stop_strings_across_the_break": stops,
            "stop_strings_found": stops_held}


def main() -> None:
    print(json.dumps(check(str(build_model(default_model_dir("small"))))))


if __name__ == "__main__":
    main()
