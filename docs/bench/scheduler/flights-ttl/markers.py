"""What the flights bucket keeps after flights end: the real ``services.ledger.Ledger`` on a
fresh ``LocalNatsServer`` (JetStream, R1). Writes N flight records the way a scheduler
does (created, rewritten, then ``Ledger.forget``; records of a 128-token request's
sizes, 886 and 1002 B), then reads the bucket's stream state at once
and again after ``--wait-s``. ``--deadline-s`` is the scheduler's deadline (the TTL, where
the code sets one, is 2 x deadline + 60 s). Run from the root of the checkout to measure:

    python docs/bench/scheduler/flights-ttl/markers.py --deadline-s 0.5 --wait-s 70 > out.json
"""

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.getcwd())


async def main(args) -> dict:
    import nats

    from kvpush.services.launch.natsd import LocalNatsServer
    from kvpush.services.ledger import Ledger
    from kvpush.shared import wire

    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    with LocalNatsServer() as server:
        nc = await nats.connect(server.url)
        ledger = await Ledger.open(nc, deadline_s=args.deadline_s)
        js = nc.jetstream()

        async def state() -> dict:
            info = await js.stream_info(f"KV_{wire.FLIGHTS_BUCKET}")
            return {"messages": info.state.messages, "bytes": info.state.bytes, "at_s": round(time.monotonic() - t0, 1)}

        t0 = time.monotonic()
        config = (await js.stream_info(f"KV_{wire.FLIGHTS_BUCKET}")).config
        for i in range(args.flights):
            key = f"m-{i}"
            revision = await ledger.flights.create(key, b"x" * 886)  # a 128-token request's record size
            revision = await ledger.flights.update(key, b"y" * 1002, last=revision)
            await ledger.forget(key, revision)
        after_writes = await state()
        await asyncio.sleep(args.wait_s)
        later = await state()
        await nc.close()
    return {"commit": commit, "deadline_s": args.deadline_s, "flights": args.flights,
            "stream_max_age_s": config.max_age, "after_writes": after_writes, "after_wait": later,
            "what": "the KV_kvpush_flights stream after N flights were created, rewritten and deleted "
                    "(Ledger.forget), at once and after --wait-s"}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--flights", type=int, default=1000)
    parser.add_argument("--deadline-s", type=float, default=0.5)
    parser.add_argument("--wait-s", type=float, default=70.0)
    print(json.dumps(asyncio.run(main(parser.parse_args())), indent=1))
