"""/v1/videos on a real server over a tiny Wan2.2 TI2V checkpoint (random weights, float32 on the CPU): a job goes
queued -> in_progress -> completed, and its mp4, decoded with PyAV, has the asked frame count, rate and size and
the frames the engine made (the same request through the Python API, encoded alike: equal but for a few pixels a
batched forward rounds otherwise; against the raw frames within H.264's loss), and its thumbnail is the first frame;
an input_reference is the first frame the engine gets; DELETE of a running job aborts it in the engine and removes
its files; the sync route answers the mp4, and a client that leaves it aborts the generation; a server that stops
records its unfinished jobs failed, and the next one reports them; 404 / 409 / 429 / 400 / 413 paths; ownership
between two API keys; the OpenAI client's videos resource."""

from __future__ import annotations

import io
import json
import queue
import time
import uuid
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

pytest.importorskip("diffusers")
av = pytest.importorskip("av")

from openai_helpers import assert_openai_error, wait_for  # noqa: E402

from omnistage.entrypoints.openai.server import BackgroundServer, ServerOptions  # noqa: E402

KEYS = ("key-alice", "key-bob")
FAST = {"size": "64x32", "num_frames": "5", "fps": "8", "num_inference_steps": "2", "seed": "7",
        "max_sequence_length": "32"}
SLOW = {**FAST, "num_inference_steps": "1000"}  # long enough to be caught running
TYPED = {k: v if k == "size" else int(v) for k, v in FAST.items()}  # the same fields in a JSON body
LIMITS = {"max_media_bytes": 64 * 1024, "max_video_pixels": 64 * 64 * 9}


@pytest.fixture(scope="module")
def wan_path() -> str:
    from omnistage.testing.wan import tiny_wan

    return str(tiny_wan("ti2v"))


@pytest.fixture(scope="module")
def engine(wan_path: str):
    from omnistage.entrypoints.async_omni import AsyncOmni

    deploy = {"worker_backend": "inline", "stages": {"*": {"dtype": "float32", "devices": "cpu"}}, "limits": LIMITS}
    engine = AsyncOmni.from_model(wan_path, deploy, served_model_name="wan")
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def server(engine, tmp_path_factory):
    options = ServerOptions(api_keys=KEYS, video_jobs_dir=str(tmp_path_factory.mktemp("jobs")), max_video_jobs=2)
    with BackgroundServer(engine, options=options) as server:
        yield server


def http(server: BackgroundServer, key: str = KEYS[0]) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def jobs_dir(server: BackgroundServer) -> Path:
    return Path(server.app.state.edge.options.video_jobs_dir)


def dit_stats(engine) -> dict:
    return engine.stats()["dit"]


def poll(client: httpx.Client, video_id: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    seen = set()
    while time.monotonic() < deadline:
        job = client.get(f"/v1/videos/{video_id}").json()
        seen.add(job["status"])
        if job["status"] in ("completed", "failed"):
            job["seen"] = seen
            return job
        time.sleep(0.05)
    raise AssertionError(f"job {video_id} did not finish: {job}")


def decode(data: bytes) -> tuple[np.ndarray, float]:
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(stream)])
        return frames, float(stream.average_rate)


def difference(a: np.ndarray, b: np.ndarray) -> float:
    """Mean absolute pixel difference. Frames of the same request match closely, not always exactly: a request
    batched with others may round a few pixels the other way, and H.264 then codes the frame a little otherwise."""
    return float(np.abs(a.astype(int) - b).mean())


def python_api(engine, image=None, **params) -> tuple[np.ndarray, float]:
    """The same generation through the engine's Python side (the orchestrator); `image`: the first frame."""
    from omnistage.engine.diffusion.params import DiffusionParams
    from omnistage.types import OmniOutput, OmniRequest

    done: queue.SimpleQueue = queue.SimpleQueue()
    request = OmniRequest(f"py-{uuid.uuid4().hex}", prompt=params.pop("prompt"), output_modalities=("video",),
                          media={"image": [image]} if image is not None else {},
                          options={"diffusion": DiffusionParams(**params)})
    engine.orchestrator.submit(request, done.put)
    merged = OmniOutput(request.request_id)
    while not merged.finished:
        merged.merge(done.get(timeout=120))
    assert merged.error is None, merged.error
    return merged.videos[0], merged.fps


def test_create_poll_download(server, engine) -> None:
    with http(server) as client:
        resp = client.post("/v1/videos", data={"prompt": "a red fox", "model": "wan", **FAST})
        assert resp.status_code == 200, resp.text
        job = resp.json()
        assert job["object"] == "video" and job["status"] == "queued" and job["model"] == "wan"
        assert job["id"].startswith("video_") and job["progress"] == 0 and job["completed_at"] is None
        assert job["size"] == "64x32" and job["seconds"] == "0.62" and (job["num_frames"], job["fps"]) == (5, 8)
    with http(server) as client:  # the client that made it is gone: the job runs on
        done = poll(client, job["id"])
        assert done["status"] == "completed" and done["progress"] == 100 and done["error"] is None, done
        assert done["completed_at"] >= done["created_at"] and done["expires_at"] > done["completed_at"]
        content = client.get(f"/v1/videos/{job['id']}/content")
    assert content.status_code == 200 and content.headers["content-type"] == "video/mp4"
    frames, fps = decode(content.content)
    assert frames.shape == (5, 32, 64, 3) and fps == 8
    reference, ref_fps = python_api(engine, prompt="a red fox", width=64, height=32, num_frames=5, fps=8,
                                    num_inference_steps=2, seed=7, max_sequence_length=32)
    assert ref_fps == 8 and reference.shape == (5, 32, 64, 3)
    from omnistage.media.video import encode_mp4

    assert difference(frames, decode(encode_mp4(reference, 8))[0]) < 1  # the engine's frames, encoded alike
    # Against the raw frames: random weights make pixel noise, whose colour yuv420p halves (one chroma sample per
    # 2x2 pixels), so the bound is on luma, where only H.264's quantization at crf 18 loses.
    luma = np.array([0.299, 0.587, 0.114])
    error = np.abs(frames @ luma - reference @ luma)
    assert error.mean() < 6, error.mean()
    assert (jobs_dir(server) / f"{job['id']}.mp4").read_bytes() == content.content
    with http(server) as client:
        thumb = client.get(f"/v1/videos/{job['id']}/content", params={"variant": "thumbnail"})
    assert thumb.status_code == 200 and thumb.headers["content-type"] == "image/webp"
    from PIL import Image

    first = np.asarray(Image.open(io.BytesIO(thumb.content)).convert("RGB"))
    assert first.shape == (32, 64, 3) and difference(first, frames[0]) < 8  # WebP is lossy too


def test_delete_cancels_a_running_job(server, engine) -> None:
    with http(server) as client:
        job = client.post("/v1/videos", data={"prompt": "a long one", **SLOW}).json()
        assert wait_for(lambda: client.get(f"/v1/videos/{job['id']}").json()["progress"] > 0, 60)
        running = client.get(f"/v1/videos/{job['id']}").json()
        assert running["status"] == "in_progress" and 0 < running["progress"] < 100
        assert (jobs_dir(server) / f"{job['id']}.json").exists()
        gone = client.delete(f"/v1/videos/{job['id']}")
        assert gone.status_code == 200 and gone.json() == {"id": job["id"], "object": "video.deleted",
                                                           "deleted": True}
        # aborted in the engine: nothing runs, and the step counter stops long before 1000 steps
        assert wait_for(lambda: dit_stats(engine)["num_running"] == 0 and dit_stats(engine)["num_waiting"] == 0,
                        10), dit_stats(engine)
        steps = dit_stats(engine)["num_steps"]
        time.sleep(0.3)
        assert dit_stats(engine)["num_steps"] == steps
        assert_openai_error(client.get(f"/v1/videos/{job['id']}"), 404, "no video")
        assert_openai_error(client.delete(f"/v1/videos/{job['id']}"), 404)
        assert not list(jobs_dir(server).glob(f"{job['id']}*"))
        assert job["id"] not in [v["id"] for v in client.get("/v1/videos").json()["data"]]


def test_too_many_unfinished_jobs_is_429(server) -> None:
    with http(server) as client:
        first = [client.post("/v1/videos", data={"prompt": f"slow {i}", **SLOW}).json() for i in range(2)]
        resp = client.post("/v1/videos", data={"prompt": "one more", **FAST})
        err = assert_openai_error(resp, 429, "limit of 2 unfinished video jobs")
        assert err["type"] == "rate_limit_exceeded" and resp.headers["retry-after"]
        for job in first:
            assert client.delete(f"/v1/videos/{job['id']}").status_code == 200
        again = client.post("/v1/videos", data={"prompt": "now it fits", **FAST})
        assert again.status_code == 200 and poll(client, again.json()["id"])["status"] == "completed"


def test_list_newest_first(server) -> None:
    with http(server, KEYS[1]) as client:
        ids = [client.post("/v1/videos", json={"prompt": f"list {i}", **TYPED}).json()["id"] for i in range(2)]
        for video_id in ids:
            poll(client, video_id)
        page = client.get("/v1/videos").json()
        assert page["object"] == "list" and [v["id"] for v in page["data"]] == ids[::-1]
        assert page["first_id"] == ids[1] and page["last_id"] == ids[0] and page["has_more"] is False
        first = client.get("/v1/videos", params={"limit": 1}).json()
        assert [v["id"] for v in first["data"]] == [ids[1]] and first["has_more"] is True
        rest = client.get("/v1/videos", params={"limit": 1, "after": ids[1]}).json()
        assert [v["id"] for v in rest["data"]] == [ids[0]]
        assert [v["id"] for v in client.get("/v1/videos", params={"order": "asc"}).json()["data"]] == ids
        assert_openai_error(client.get("/v1/videos", params={"limit": 0}), 400, "limit")


def test_ownership_between_keys(server) -> None:
    with http(server, KEYS[0]) as alice, http(server, KEYS[1]) as bob:
        job = alice.post("/v1/videos", data={"prompt": "alice's", **FAST}).json()
        poll(alice, job["id"])
        for method, path in (("GET", ""), ("GET", "/content"), ("DELETE", "")):
            assert_openai_error(bob.request(method, f"/v1/videos/{job['id']}{path}"), 404, "no video")
        assert job["id"] not in [v["id"] for v in bob.get("/v1/videos").json()["data"]]
        assert job["id"] in [v["id"] for v in alice.get("/v1/videos").json()["data"]]
        assert alice.get(f"/v1/videos/{job['id']}/content").status_code == 200
        record = (jobs_dir(server) / f"{job['id']}.json").read_text()
        assert KEYS[0] not in record and json.loads(record)["owner"]
        with httpx.Client(base_url=server.url) as anonymous:
            assert anonymous.get(f"/v1/videos/{job['id']}").status_code == 401


def test_sync_route(server, engine) -> None:
    with http(server) as client:
        resp = client.post("/v1/videos/sync", data={"prompt": "a red fox", **FAST})
    assert resp.status_code == 200 and resp.headers["content-type"] == "video/mp4"
    frames, fps = decode(resp.content)
    assert frames.shape == (5, 32, 64, 3) and fps == 8
    reference, _ = python_api(engine, prompt="a red fox", width=64, height=32, num_frames=5, fps=8,
                              num_inference_steps=2, seed=7, max_sequence_length=32)
    from omnistage.media.video import encode_mp4

    assert difference(frames, decode(encode_mp4(reference, 8))[0]) < 1


def test_sync_client_that_leaves_aborts(server, engine) -> None:
    with pytest.raises(httpx.ReadTimeout), http(server) as client:
        client.post("/v1/videos/sync", data={"prompt": "never mind", **SLOW}, timeout=1.0)
    assert wait_for(lambda: dit_stats(engine)["num_running"] == 0 and dit_stats(engine)["num_waiting"] == 0, 10)
    steps = dit_stats(engine)["num_steps"]
    time.sleep(0.3)
    assert dit_stats(engine)["num_steps"] == steps


def _png(size: int) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (size, size, 3), dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


@pytest.mark.parametrize(("fields", "status", "param", "words"), [
    ({"size": "48x32"}, 400, "width", "multiple of 32"),
    ({"num_frames": "6"}, 400, "num_frames", "4k+1"),
    ({"size": "64x64", "num_frames": "17"}, 400, "num_frames", "limits.max_video_pixels"),
    ({"size": "big"}, 400, "size", "WIDTHxHEIGHT"),
    ({"num_inference_steps": "many"}, 400, "num_inference_steps", "num_inference_steps"),
    ({"seconds": "4", "num_frames": "5"}, 400, "seconds", "not both"),
    ({"seconds": "soon"}, 400, "seconds", "number of seconds"),
    ({"prompt": ""}, 400, "prompt", "'prompt' is required"),
    ({"model": "sora-2"}, 404, "model", "does not exist"),
    ({"guidance_scale": "-1"}, 400, "guidance_scale", "guidance_scale"),
    ({"extra_body": "{not json"}, 400, "extra_body", "extra_body"),
    ({"lora": "{\"path\": 3}"}, 400, "lora.path", "lora"),
])
def test_bad_fields_are_refused_before_queueing(server, fields, status, param, words) -> None:
    with http(server) as client:
        before = len(client.get("/v1/videos", params={"limit": 100}).json()["data"])
        for route in ("/v1/videos", "/v1/videos/sync"):
            err = assert_openai_error(client.post(route, data={"prompt": "x", **FAST, **fields}), status, words)
            assert err["param"] == param, err
        assert len(client.get("/v1/videos", params={"limit": 100}).json()["data"]) == before


def test_seconds_become_frames_the_model_takes(server) -> None:
    """1 s at 8 fps is 8 frames, rounded to Wan's 4k+1: 9."""
    with http(server) as client:
        fields = {k: v for k, v in FAST.items() if k != "num_frames"}
        job = client.post("/v1/videos", data={"prompt": "one second", **fields, "seconds": "1"})
        assert job.status_code == 200, job.text
        assert job.json()["num_frames"] == 9 and job.json()["seconds"] == "1.12"
        assert client.delete(f"/v1/videos/{job.json()['id']}").status_code == 200


def test_input_reference_animates_the_image(server, engine) -> None:
    """TI2V takes an optional first frame: uploaded, or as an image_url (a data URL) in a JSON body, it gives the
    frames the Python API gives for that image, and a video other than the one without it."""
    import base64

    from PIL import Image

    png = _png(48)
    image = Image.open(io.BytesIO(png)).convert("RGB")
    reference, _ = python_api(engine, prompt="a red fox", width=64, height=32, num_frames=5, fps=8,
                              num_inference_steps=2, seed=7, max_sequence_length=32, image=image)
    from omnistage.media.video import encode_mp4

    expected = decode(encode_mp4(reference, 8))[0]
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    with http(server) as client:
        uploaded = client.post("/v1/videos", data={"prompt": "a red fox", **FAST},
                               files={"input_reference": ("first.png", png, "image/png")}).json()
        by_url = client.post("/v1/videos", json={"prompt": "a red fox", **TYPED, "input_reference": {"image_url": url}})
        assert by_url.status_code == 200, by_url.text
        for job in (uploaded, by_url.json()):
            assert poll(client, job["id"])["status"] == "completed"
            frames, _ = decode(client.get(f"/v1/videos/{job['id']}/content").content)
            assert difference(frames, expected) < 1, difference(frames, expected)
        plain = client.post("/v1/videos/sync", data={"prompt": "a red fox", **FAST})
        assert difference(decode(plain.content)[0], expected) > 5, difference(decode(plain.content)[0], expected)


def test_input_reference_limits(server) -> None:
    with http(server) as client:
        err = assert_openai_error(client.post("/v1/videos", data={"prompt": "x", **FAST},
                                              files={"input_reference": ("big.png", _png(200), "image/png")}), 413,
                                  "limits.max_media_bytes")
        assert err["param"] == "input_reference"
        err = assert_openai_error(client.post("/v1/videos", data={"prompt": "x", **FAST},
                                              files={"input_reference": ("x.png", b"not an image", "image/png")}),
                                  400, "could not decode the image")
        assert err["param"] == "input_reference"
        err = assert_openai_error(client.post("/v1/videos", json={"prompt": "x", **TYPED,
                                                                  "input_reference": {"file_id": "file-1"}}),
                                  400, "file_id")
        assert err["param"] == "input_reference"
        err = assert_openai_error(client.post("/v1/videos", data={"prompt": "x", **FAST},
                                              files={"seed": ("seed.txt", b"1", "text/plain")}), 400, "text field")
        assert err["param"] == "seed"


@pytest.mark.parametrize(("variant", "image", "words"), [("t2v", True, "from text alone"),
                                                         ("i2v", False, "animates an image")])
def test_image_refused_or_required(variant: str, image: bool, words: str) -> None:
    """The checks a text-only and an image-only checkpoint make before anything is queued (their real pipelines,
    loaded without weights)."""
    from types import SimpleNamespace

    from PIL import Image

    from omnistage.entrypoints.openai.videos import VideoFields
    from omnistage.errors import RequestError
    from omnistage.families.registry import load_pipeline
    from omnistage.testing.wan import tiny_wan

    engine = SimpleNamespace(pipeline=load_pipeline(tiny_wan(variant)))
    fields = VideoFields.parse({"prompt": "x", "size": "48x32", "num_frames": 5})
    with pytest.raises(RequestError, match=words) as caught:
        fields.to_request(engine, "r", Image.new("RGB", (48, 32)) if image else None)
    assert caught.value.param == "input_reference" and caught.value.status == 400
    request, params = fields.to_request(engine, "r", None if image else Image.new("RGB", (48, 32)))
    assert (params.width, params.height, params.num_frames) == (48, 32, 5)
    assert request.output_modalities == ("video",)


def test_unknown_ids_are_404(server) -> None:
    with http(server) as client:
        for video_id in ("video_" + "0" * 32, "nope", "..%2F..%2Fetc%2Fpasswd"):
            assert_openai_error(client.get(f"/v1/videos/{video_id}"), 404)
            assert_openai_error(client.get(f"/v1/videos/{video_id}/content"), 404)
            assert_openai_error(client.delete(f"/v1/videos/{video_id}"), 404)


def test_content_before_completion_is_409(server) -> None:
    with http(server) as client:
        job = client.post("/v1/videos", data={"prompt": "not yet", **SLOW}).json()
        assert_openai_error(client.get(f"/v1/videos/{job['id']}/content"), 409, "not ready")
        assert_openai_error(client.get(f"/v1/videos/{job['id']}/content", params={"variant": "spritesheet"}),
                            400, "variant")
        assert client.delete(f"/v1/videos/{job['id']}").status_code == 200


def test_openai_client(server) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEYS[0], max_retries=0)
    extra = {k: v for k, v in FAST.items() if k != "size"}
    with pytest.warns(DeprecationWarning):  # the SDK marks its Sora API deprecated
        video = client.videos.create(model="wan", prompt="a red fox", size="64x32", extra_body=extra)
    assert video.status == "queued" and video.size == "64x32"
    with pytest.warns(DeprecationWarning):
        done = client.videos.poll(video.id, poll_interval_ms=50)
        assert done.status == "completed" and done.progress == 100
        frames, fps = decode(client.videos.download_content(video.id).read())
        assert frames.shape == (5, 32, 64, 3) and fps == 8
        assert video.id in [v.id for v in client.videos.list()]
        assert client.videos.delete(video.id).deleted
        with pytest.raises(openai.NotFoundError):
            client.videos.retrieve(video.id)


def test_a_model_without_video_is_400(fake_served) -> None:
    with fake_served.http() as client:
        for method, path in (("POST", "/v1/videos"), ("POST", "/v1/videos/sync"), ("GET", "/v1/videos"),
                             ("GET", "/v1/videos/video_" + "0" * 32)):
            resp = client.request(method, path, data={"prompt": "a fox"})
            err = assert_openai_error(resp, 400, "does not generate video")
            assert err["param"] == "model"


def test_stopping_fails_unfinished_jobs_and_a_new_server_reports_them(engine, tmp_path) -> None:
    """A server that stops with a job running aborts it in the engine and records it failed; the next server on the
    directory reports it so (a crash, where nothing is recorded, is the store's restart case: test_video_jobs)."""
    options = ServerOptions(api_keys=KEYS, video_jobs_dir=str(tmp_path))
    first = BackgroundServer(engine, options=options).start()
    with http(first) as client:
        job = client.post("/v1/videos", data={"prompt": "cut short", **SLOW}).json()
        assert wait_for(lambda: client.get(f"/v1/videos/{job['id']}").json()["progress"] > 0, 60)
    first.stop()
    assert wait_for(lambda: dit_stats(engine)["num_running"] == 0 and dit_stats(engine)["num_waiting"] == 0, 10)
    assert json.loads((tmp_path / f"{job['id']}.json").read_text())["status"] == "failed"
    first.app.state.video_jobs.close()  # what the process ending does
    with BackgroundServer(engine, options=options) as second, http(second) as client:
        again = client.get(f"/v1/videos/{job['id']}").json()
        assert again["status"] == "failed" and "submit the request again" in again["error"]["message"]
        assert_openai_error(client.get(f"/v1/videos/{job['id']}/content"), 400, "not ready")
