"""`omnistage serve` with stage worker processes: /metrics shows the stages, and SIGTERM or
SIGINT stops the server, every stage process, and frees every shared memory segment."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest


def children_of(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_stops_every_stage_process(tiny_qwen2: str, tmp_path: Path, sig: signal.Signals) -> None:
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text("worker_backend: process\nstages:\n  lm:\n    max_model_len: 128\n")
    port = free_port()
    log = (tmp_path / "server.log").open("w+")
    server = subprocess.Popen(
        [sys.executable, "-m", "omnistage", "serve", tiny_qwen2, "--deploy-config", str(deploy),
         "--port", str(port), "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, Path(log.name).read_text()
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server never became healthy"
            time.sleep(0.2)
        workers = children_of(server.pid)
        assert workers, "no stage worker process"
        reply = httpx.post(f"{url}/v1/completions", json={"model": Path(tiny_qwen2).name, "prompt": "Hi",
                                                           "max_tokens": 4}, timeout=30)
        assert reply.status_code == 200, reply.text
        metrics = httpx.get(f"{url}/metrics", timeout=5).text
        assert 'omnistage_stage_up{replica="0",stage="lm"} 1.0' in metrics
        assert 'omnistage_stage_transfer_bytes_total{direction="out",replica="0",stage="lm"}' in metrics
        assert 'omnistage_stage_loop_seconds_total{part="report",replica="0",stage="lm"}' in metrics

        server.send_signal(sig)
        assert server.wait(30) is not None
        for pid in workers:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
        assert list(Path("/dev/shm").glob(f"omnistage-{server.pid}-*")) == []
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        log.close()


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's new parent may be slow to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_workers_follow_a_killed_orchestrator(tiny_qwen2: str) -> None:
    """SIGKILL leaves no chance to clean up: the workers notice, free the links and exit."""
    script = (
        "import os\n"
        "from omnistage import Omni, SamplingParams\n"
        f"omni = Omni({tiny_qwen2!r}, {{'worker_backend': 'process'}})\n"
        "omni.generate('Hi', SamplingParams(max_tokens=2))\n"
        "print(os.getpid(), *[w.handle.proc.pid for w in omni.orchestrator.workers['lm']], flush=True)\n"
        "os.kill(os.getpid(), 9)\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == -signal.SIGKILL, run.stderr
    orchestrator, *workers = (int(p) for p in run.stdout.split())
    deadline = time.monotonic() + 10
    while any(running(pid) for pid in workers):
        assert time.monotonic() < deadline, "a worker outlived its orchestrator"
        time.sleep(0.1)
    assert list(Path("/dev/shm").glob(f"omnistage-{orchestrator}-*")) == []
