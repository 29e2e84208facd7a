"""Soak a server on loopback: find its saturation throughput, then offer twice that for N minutes.

    python tools/soak.py --minutes 4                     # starts `omnistage serve` on a tiny checkpoint
    python tools/soak.py --base-url http://host:8000 --model NAME --minutes 10

Saturation: closed-loop clients at rising concurrency until throughput stops growing. Soak: open-loop (Poisson)
arrivals at 2x that rate, so the server must refuse what it cannot take (429/503) instead of queueing without
bound. Prints one JSON line per sample (every `--sample-s`: the server's RSS when this script started it, the
status counts and p50/p99 latency of the requests finished since the last sample) and a summary line at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

API_KEY = "soak-key"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(arch: str, port: int) -> tuple[subprocess.Popen, str]:
    ckpt = Path(tempfile.mkdtemp(prefix="soak-")) / arch
    subprocess.run([sys.executable, "-m", "omnistage", "make-tiny", str(ckpt), "--arch", arch], check=True,
                   stdout=subprocess.DEVNULL)
    server = subprocess.Popen([sys.executable, "-m", "omnistage", "serve", str(ckpt), "--port", str(port),
                               "--api-key", API_KEY, "--served-model-name", "soak", "--log-level", "warning"])
    return server, "soak"


def rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


async def wait_ready(client: httpx.AsyncClient, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if (await client.get("/health")).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.5)
    raise SystemExit("server did not become healthy")


def body(model: str, rng: random.Random, max_tokens: int) -> dict:
    words = " ".join(rng.choice(["river", "stone", "light", "wind", "the", "a", "of"]) for _ in range(20))
    return {"model": model, "messages": [{"role": "user", "content": words}], "max_tokens": max_tokens,
            "temperature": 0.7, "seed": rng.randrange(2**31)}


class Tally:
    def __init__(self) -> None:
        self.statuses: collections.Counter[str] = collections.Counter()
        self.latencies: list[float] = []

    def add(self, status: str, latency: float) -> None:
        self.statuses[status] += 1
        if status == "200":
            self.latencies.append(latency)

    def take(self) -> Tally:
        """What was tallied so far; this tally starts again empty."""
        taken = Tally()
        taken.statuses, taken.latencies = self.statuses, self.latencies
        self.statuses, self.latencies = collections.Counter(), []
        return taken


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def one(client: httpx.AsyncClient, payload: dict, tally: Tally) -> None:
    start = time.perf_counter()
    try:
        resp = await client.post("/v1/chat/completions", json=payload)
        status = str(resp.status_code)
    except httpx.TimeoutException:
        status = "timeout"
    except httpx.HTTPError as exc:
        status = type(exc).__name__
    tally.add(status, time.perf_counter() - start)


async def saturation(client: httpx.AsyncClient, model: str, max_tokens: int, seconds: float) -> float:
    """Requests a second at the concurrency past which throughput grows by less than 10%."""
    rng, best = random.Random(0), 0.0
    for concurrency in (1, 2, 4, 8, 16, 32, 64, 128):
        done, stop = 0, time.monotonic() + seconds

        async def worker(stop: float = stop) -> None:
            nonlocal done
            while time.monotonic() < stop:
                tally = Tally()
                await one(client, body(model, rng, max_tokens), tally)
                done += tally.statuses["200"]

        start = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        rate = done / (time.monotonic() - start)
        print(json.dumps({"phase": "saturation", "concurrency": concurrency, "req_per_s": round(rate, 2)}), flush=True)
        if rate < best * 1.1:
            return max(best, rate)
        best = rate
    return best


async def soak(args: argparse.Namespace, client: httpx.AsyncClient, pid: int | None) -> dict:
    rate = args.rate or 2 * await saturation(client, args.model, args.max_tokens, args.saturation_s)
    rng, tally, total = random.Random(1), Tally(), Tally()
    tasks: set[asyncio.Task] = set()
    end, next_sample, rss0 = time.monotonic() + args.minutes * 60, time.monotonic() + args.sample_s, None
    rss_peak = 0
    if pid is not None:
        rss0 = rss_bytes(pid)
    while time.monotonic() < end:
        task = asyncio.create_task(one(client, body(args.model, rng, args.max_tokens), tally))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        await asyncio.sleep(rng.expovariate(rate))
        if time.monotonic() >= next_sample:
            next_sample += args.sample_s
            window = tally.take()
            total.statuses.update(window.statuses)
            total.latencies += window.latencies
            rss = rss_bytes(pid) if pid is not None else None
            rss_peak = max(rss_peak, rss or 0)
            print(json.dumps({"phase": "soak", "offered_req_per_s": round(rate, 2), "in_flight": len(tasks),
                              "statuses": dict(window.statuses), "p50_s": percentile(window.latencies, 0.5),
                              "p99_s": percentile(window.latencies, 0.99),
                              "rss_mb": rss and round(rss / 2**20)}), flush=True)
    await asyncio.gather(*tasks)
    window = tally.take()
    total.statuses.update(window.statuses)
    total.latencies += window.latencies
    return {"phase": "summary", "minutes": args.minutes, "offered_req_per_s": round(rate, 2),
            "statuses": dict(total.statuses), "p50_s": percentile(total.latencies, 0.5),
            "p99_s": percentile(total.latencies, 0.99),
            "rss_start_mb": rss0 and round(rss0 / 2**20), "rss_peak_mb": rss_peak and round(rss_peak / 2**20),
            "rss_end_mb": pid is not None and round((rss_bytes(pid) or 0) / 2**20)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", help="a running server (default: start one on a tiny checkpoint)")
    parser.add_argument("--model", default="soak", help="the model name to send")
    parser.add_argument("--arch", default="qwen2", help="tiny checkpoint to serve when starting a server")
    parser.add_argument("--minutes", type=float, default=4.0)
    parser.add_argument("--rate", type=float, help="offered requests a second (default: 2x measured saturation)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--saturation-s", type=float, default=10.0, help="seconds per concurrency level")
    parser.add_argument("--sample-s", type=float, default=10.0)
    args = parser.parse_args()
    server = None
    if args.base_url is None:
        port = _free_port()
        server, args.model = start_server(args.arch, port)
        args.base_url = f"http://127.0.0.1:{port}"
    api_key = os.environ.get("OPENAI_API_KEY", API_KEY)
    try:
        async def run() -> dict:
            limits = httpx.Limits(max_connections=4096, max_keepalive_connections=512)
            async with httpx.AsyncClient(base_url=args.base_url, timeout=120, limits=limits,
                                         headers={"Authorization": f"Bearer {api_key}"}) as client:
                await wait_ready(client)
                return await soak(args, client, server.pid if server else None)

        print(json.dumps(asyncio.run(run())), flush=True)
    finally:
        if server is not None:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
