#!/bin/bash
# usage: profile.sh MODE OUTDIR (run from anywhere; the checkout is /work/main on the machine that ran it)
MODE=$1; OUT=$2; mkdir -p $OUT
cd /work/main
.venv/bin/python -m kvpush.tools.bench.ab_point --repo /work/main --model /root/.cache/kvpush/models/kv-heavy \
  --binding split --mode $MODE --rate 2 --requests 40 --out $OUT/point.json > $OUT/point.log 2>&1 &
APID=$!
# wait for the prefill engine core
for i in $(seq 1 120); do
  for p in $(pgrep -f "VLLM::EngineCore"); do
    if ps -o args= -p $(ps -o ppid= -p $p) | grep -q -- "--role prefill"; then PF=$p; fi
  done
  [ -n "$PF" ] && break
  sleep 1
done
# wait until the load starts: warm-ups done ~ when the point's json isn't there; just wait 25 s after the engine appears
for i in $(seq 1 200); do [ -f $OUT/point.json.load ] && break; sleep 0.5; done
sleep 2
PF=""
for p in $(pgrep -f "VLLM::EngineCore"); do
  if ps -o args= -p $(ps -o ppid= -p $p) | grep -q -- "--role prefill"; then PF=$p; fi
done
echo "pid $PF $(date +%T)" >> $OUT/pyspy.log
.venv/bin/py-spy record --pid $PF --native --threads --rate 200 --duration 16 --format raw --output $OUT/prefill-engine.txt > $OUT/pyspy.log 2>&1
wait $APID
echo done >> $OUT/pyspy.log
