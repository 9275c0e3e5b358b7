#!/usr/bin/env bash
# Issue 44: the shm queue's pacing at TP 2 on both sides, kv-heavy 1k, 0.5 req/s, 16 requests.
cd "$(git rev-parse --show-toplevel)"
for mode in backoff paced on; do
  KVPUSH_SHM_SPIN=$mode timeout 900 .venv/bin/kvpush bench --systems kvpush-push,kvpush-pull --input-lens 1024 --rates 0.5 \
    --requests 16 --warmup 1 --binding kvpush=auto --no-raw-nixl --at-rest-s 10 --prefill-tp 2 --decode-tp 2 \
    --out docs/bench/tp-44/spin/$mode > docs/bench/tp-44/spin/$mode.log 2>&1
  echo "$mode rc=$? $(date +%T)" >> docs/bench/tp-44/spin/done.txt
done
