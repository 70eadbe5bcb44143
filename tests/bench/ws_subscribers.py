"""Websocket subscribers for the stream benchmark, in a process of their own (as browsers would be).

    python tests/bench/ws_subscribers.py URL ORIGIN COUNT MESSAGES

Prints "ready" once every socket is open, then one JSON list of latencies (seconds, receive time
minus the `emitted` time in each `message` event) when each socket got MESSAGES of them.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import websockets


async def main(url: str, origin: str, count: int, messages: int) -> list[float]:
    latencies: list[float] = []

    async def one(ws) -> None:  # noqa: ANN001
        await ws.recv()  # backlog
        received = 0
        while received < messages:
            raw = await ws.recv()
            now = time.time()
            for event in json.loads(raw).get("events", []):
                if event["kind"] == "message":
                    latencies.append(now - event["payload"]["emitted"])
                    received += 1

    sockets = [await websockets.connect(url, origin=origin, open_timeout=30) for _ in range(count)]
    print("ready", flush=True)
    await asyncio.wait_for(asyncio.gather(*(one(ws) for ws in sockets)), timeout=300)
    for ws in sockets:
        await ws.close()
    return latencies


if __name__ == "__main__":
    url, origin, count, messages = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    print(json.dumps(asyncio.run(main(url, origin, count, messages))), flush=True)
