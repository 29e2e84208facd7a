"""Start-up and shutdown as an operator sees them, with real processes: `omnistage serve` binds its port before
loading and reports the loading stage on /health; what cannot start fails in one line; SIGTERM drains (new
requests 503, running ones finish up to --shutdown-timeout-s, then are aborted) and leaves no stage process
or shared-memory segment behind. The drain's timing runs over the scripted FakeEngine in a real process."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from omnistage.entrypoints.async_omni import AsyncOmni

HERE = Path(__file__).parent
REPO = HERE.parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _one_line_error(proc: subprocess.CompletedProcess[str], *words: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for word in words:
        assert word in lines[0], lines[0]


def test_busy_port_fails_at_once() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "omnistage", "serve", "/no/model/needed", "--port", str(port)],
                              capture_output=True, text=True, timeout=60)
    _one_line_error(proc, f"127.0.0.1:{port}", "in use", "--port")
    assert time.monotonic() - start < 5  # before anything heavy is imported, let alone loaded


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without CUDA")
def test_gpu_deploy_config_on_a_cpu_host_is_one_line(tiny_qwen2_5_omni: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "omnistage", "serve", tiny_qwen2_5_omni, "--deploy-config",
                           str(REPO / "configs/qwen2_5_omni/1gpu.yaml"), "--port", str(free_port())],
                          capture_output=True, text=True, timeout=120)
    _one_line_error(proc, "stage 'thinker'", "no CUDA GPU", "devices=cpu")


def test_async_omni_reports_loading_progress(tiny_qwen2: str) -> None:
    heard: list[str] = []
    engine = AsyncOmni(tiny_qwen2, {"worker_backend": "inline"}, on_progress=heard.append)
    engine.shutdown()
    assert heard == ["reading the checkpoint and the deploy config", "loading stage 'lm' (1 of 1)"]


def _wait_health(url: str, server: subprocess.Popen, log: Path, timeout: float = 120) -> list[tuple[int, dict]]:
    """Poll /health until 200; every distinct answer on the way."""
    seen: list[tuple[int, dict]] = []
    deadline = time.monotonic() + timeout
    while True:
        assert server.poll() is None, log.read_text()
        try:
            resp = httpx.get(f"{url}/health", timeout=5)
            answer = (resp.status_code, resp.json())
            if not seen or seen[-1] != answer:
                seen.append(answer)
            if resp.status_code == 200:
                return seen
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"never healthy: {seen}"
        time.sleep(0.05)


def _stream(url: str, body: dict[str, Any], headers: dict[str, str], events: list[str], first: threading.Event) -> None:
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, headers=headers,
                          timeout=60) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    first.set()
    except httpx.HTTPError as exc:
        events.append(f"broken: {exc!r}")
    finally:
        first.set()


def test_serve_loads_behind_health_then_sigterm_drains_and_cleans_up(tiny_qwen2: str, tmp_path: Path) -> None:
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text("worker_backend: process\nstages:\n  lm:\n    max_model_len: 1024\n")
    port, key = free_port(), "sk-do-not-log-me"
    log = tmp_path / "server.log"
    with log.open("w") as out:
        server = subprocess.Popen([sys.executable, "-m", "omnistage", "serve", tiny_qwen2, "--deploy-config",
                                   str(deploy), "--port", str(port), "--api-key", key, "--log-level", "info",
                                   "--metrics-without-auth", "--enable-docs", "--max-queued-requests", "8",
                                   "--allowed-origins", "https://app.example"],
                                  stdout=out, stderr=subprocess.STDOUT)
    url, headers = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {key}"}
    try:
        seen = _wait_health(url, server, log)
        # the stage loads in its own process (seconds): the server answers meanwhile
        assert (503, {"status": "loading", "detail": "loading stage 'lm' (1 of 1)"}) in seen, seen
        assert seen[-1][0] == 200
        workers = children_of(server.pid)
        assert workers, "no stage worker process"
        # the edge's flags reach the server
        assert "omnistage_server_max_queued_requests 8.0" in httpx.get(f"{url}/metrics").text
        assert httpx.get(f"{url}/docs").status_code == 401 and httpx.get(f"{url}/docs", headers=headers).is_success
        preflight = httpx.options(f"{url}/v1/completions", headers={"Origin": "https://app.example",
                                                                     "Access-Control-Request-Method": "POST"})
        assert preflight.headers.get("access-control-allow-origin") == "https://app.example"

        events: list[str] = []
        first = threading.Event()
        body = {"model": Path(tiny_qwen2).name, "prompt": "Hi", "max_tokens": 900, "ignore_eos": True}
        reader = threading.Thread(target=_stream, args=(url, body, headers, events, first))
        reader.start()
        assert first.wait(60) and not events[0].startswith("broken"), events
        server.send_signal(signal.SIGTERM)
        reader.join(60)
        assert events[-1] == "[DONE]", events[-3:]  # the generation in flight finished
        text = "".join(c["text"] for e in events[:-1] for c in json.loads(e)["choices"])
        assert text and server.wait(30) == 0, log.read_text()
        for pid in workers:
            assert gone(pid), f"stage process {pid} outlived the server"
        assert list(Path("/dev/shm").glob(f"omnistage-{server.pid}-*")) == []
        assert key not in log.read_text()
        # the start-up summary is there; transformers' warnings and progress bars are not
        assert "stage 'lm' ready in" in log.read_text(), log.read_text()
        assert "it/s]" not in log.read_text() and "[transformers]" not in log.read_text(), log.read_text()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


# A real server process over the FakeEngine (deterministic generation times): `serve` with real signals.
FAKE_SERVER = """
import sys
sys.path.insert(0, {here!r})
from openai_helpers import FakeEngine
from omnistage.entrypoints.openai.server import ServerOptions, bind, serve

class Engine(FakeEngine):
    def shutdown(self):
        print("engine shut down, running:", len(self.running), flush=True)

serve(lambda progress: Engine(delay=0.02), bind("127.0.0.1", {port}), ServerOptions(shutdown_timeout_s={timeout}),
      log_level="warning")
print("served", flush=True)
"""


def _fake_server(tmp_path: Path, timeout_s: float) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    log = tmp_path / "fake.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-c", FAKE_SERVER.format(here=str(HERE), port=port,
                                                                          timeout=timeout_s)],
                                stdout=out, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    _wait_health(url, proc, log, timeout=60)
    return proc, url, log


def test_sigterm_refuses_new_requests_and_lets_running_ones_finish(tmp_path: Path) -> None:
    proc, url, log = _fake_server(tmp_path, timeout_s=20)
    try:
        events: list[str] = []
        first = threading.Event()
        reader = threading.Thread(target=_stream, args=(url, {"prompt": "go", "max_tokens": 60}, {}, events, first))
        reader.start()  # 60 tokens x 20 ms: still running when the signal comes
        assert first.wait(10)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        health = httpx.get(f"{url}/health", timeout=5)
        assert health.status_code == 503 and health.json()["status"] == "draining"
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=5)
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
        assert refused.headers["retry-after"] == "5"
        reader.join(30)
        assert events[-1] == "[DONE]" and len(events) == 61, events[-3:]  # a chunk per token, then [DONE]
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        assert proc.wait(20) == 0
        assert log.read_text().split()[-6:] == ["engine", "shut", "down,", "running:", "0", "served"], log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_shutdown_timeout_aborts_what_still_runs(tmp_path: Path) -> None:
    proc, url, log = _fake_server(tmp_path, timeout_s=0.5)
    try:
        events: list[str] = []
        first = threading.Event()
        reader = threading.Thread(target=_stream, args=(url, {"prompt": "go", "max_tokens": 60}, {}, events, first))
        reader.start()
        assert first.wait(10)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        assert time.monotonic() - start < 3  # the 0.5 s deadline, not uvicorn's own 5 s grace
        reader.join(10)
        assert events[-1] != "[DONE]", "the stream should have been cut"
        output = log.read_text()
        assert "engine shut down, running: 0" in output and "served" in output, output  # aborted, then stopped
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_second_signal_stops_at_once(tmp_path: Path) -> None:
    proc, url, _ = _fake_server(tmp_path, timeout_s=30)
    try:
        events: list[str] = []
        first = threading.Event()
        reader = threading.Thread(target=_stream, args=(url, {"prompt": "go", "max_tokens": 60}, {}, events, first))
        reader.start()
        assert first.wait(10)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(10) == 0
        reader.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not os.path.exists(f"/proc/{proc.pid}/stat") or gone(proc.pid)
