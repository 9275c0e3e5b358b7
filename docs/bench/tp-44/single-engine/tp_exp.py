"""Issue 44 experiment: plain vLLM LLM at TP 1/2 on CPU; tokens, start time, KV shapes, idle CPU."""
import json, os, sys, time, random
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
import psutil

MODEL = os.path.expanduser("~/.cache/kvpush/models/small")

def tree():
    me = psutil.Process()
    return [me] + me.children(recursive=True)

def cpu_snapshot():
    snap = {}
    for p in tree():
        try:
            t = p.cpu_times(); snap[p.pid] = (p.name() + ":" + " ".join(p.cmdline()[:2])[-40:], t.user + t.system)
        except psutil.Error:
            pass
    return snap

def cpu_over(seconds, action=None):
    a = cpu_snapshot(); t0 = time.monotonic()
    if action is None:
        time.sleep(seconds)
    else:
        while time.monotonic() - t0 < seconds:
            action()
    b = cpu_snapshot(); dt = time.monotonic() - t0
    per = {f"{pid} {b[pid][0]}": round((b[pid][1] - a.get(pid, (None, 0))[1]) / dt, 3) for pid in b}
    return round(sum(per.values()), 3), per

def kv_shapes(self):
    mr = self.model_runner
    out = []
    for t in getattr(mr, "kv_caches", []) or []:
        out.append([list(t.shape), list(t.stride()), str(t.dtype), t.is_contiguous(), t.untyped_storage().data_ptr(), t.data_ptr()])
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
    return {"rank": get_tensor_model_parallel_rank(), "pid": os.getpid(), "affinity": sorted(os.sched_getaffinity(0)),
            "omp": os.environ.get("OMP_PLACES"), "kv": out}

def sleep_rpc(self, s):
    time.sleep(s); return 0


def main():
    TP = int(sys.argv[1]); TAG = sys.argv[2]; OUT = sys.argv[3]
    res = {"tp": TP, "tag": TAG, "env": {k: v for k, v in os.environ.items() if k.startswith(("VLLM_CPU", "EXP_"))}}
    t0 = time.monotonic()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    t_import = time.monotonic() - t0
    llm = LLM(model=MODEL, tokenizer=MODEL, tensor_parallel_size=TP, enforce_eager=True, dtype="float32",
              max_model_len=2048, max_num_seqs=8, enable_prefix_caching=False)
    res["import_s"] = round(t_import, 1); res["start_s"] = round(time.monotonic() - t0 - t_import, 1)
    res["workers"] = llm.collective_rpc(kv_shapes)

    rng = random.Random(44)
    prompt = [rng.randrange(1, 4096) for _ in range(192)]
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    box = {}
    def first():
        if "out" not in box:
            t1 = time.monotonic(); box["out"] = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)
            box["s"] = round(time.monotonic() - t1, 3)
    res["gen32_cpu_total"], res["gen32_cpu_per_proc"] = cpu_over(0.001, first)
    out = box["out"]; res["gen32_s"] = box["s"]
    t1 = time.monotonic(); llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)
    res["gen32_again_s"] = round(time.monotonic() - t1, 3)
    res["tokens"] = list(out[0].outputs[0].token_ids)
    # decode speed: 1 request, 256 new tokens
    sp2 = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
    t1 = time.monotonic(); llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp2, use_tqdm=False)
    res["gen256_s"] = round(time.monotonic() - t1, 3)
    # idle right after a request
    res["idle10_total"], res["idle10_per_proc"] = cpu_over(10)
    # idle again (steady state, nothing for >10 s)
    res["idle5_later_total"], _ = cpu_over(5)
    # an engine whose steps each wait 0.2 s (kvpush's idle wait in get_finished): RPCs that sleep 0.2 s
    res["sleep_rpc10_total"], res["sleep_rpc10_per_proc"] = cpu_over(10, lambda: llm.collective_rpc(sleep_rpc, args=(0.2,)))
    print(json.dumps(res, indent=1))
    json.dump(res, open(OUT, "w"), indent=1)

if __name__ == '__main__':
    main()
