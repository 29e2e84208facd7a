"""OpenAI's videos API over a model that outputs video, as asynchronous jobs, plus a synchronous route:

    POST   /v1/videos               a job: answers at once with the video object (status "queued")
    GET    /v1/videos/{id}          the object: queued -> in_progress (progress 0-100) -> completed | failed (error)
    GET    /v1/videos               the caller's jobs, newest first (OpenAI's cursor list: after, limit, order)
    GET    /v1/videos/{id}/content  the mp4 of a completed job (`variant=thumbnail`: its first frame, WebP)
    DELETE /v1/videos/{id}          cancels the job if it runs (its request is aborted in the engine), removes it
    POST   /v1/videos/sync          the same fields; answers with the mp4 once it is made (leaving aborts it)

The POST routes take a multipart form (numbers as text, as OpenAI's client sends them), a urlencoded form, or a
JSON object; an `extra_body` object (a JSON string in a form) is merged in and its keys win. Everything is checked
before a job is made: the fields' types, the model's sizes and frame counts (the family's own check,
`request_params`), the pixel limits and the input image, so a request the model cannot take is a 4xx of the POST,
never a failed job. A job then runs in the server's event loop, apart from the connection that made it (a client
that leaves does not cancel it); its records and videos are kept by `video_jobs.VideoJobStore`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from omnistage.engine.diffusion.params import DiffusionParams
from omnistage.entrypoints.openai.images import LoraSpec
from omnistage.entrypoints.openai.serving import (
    Fanout,
    check_model,
    raise_if_failed,
    run_admitted,
    validated,
    with_extra_body,
)
from omnistage.entrypoints.openai.video_jobs import JobsBusy, VideoJob, VideoJobStore, new_job_id, owner_of
from omnistage.errors import OmniError, RequestError, StageError
from omnistage.media import MediaBudget, MediaLimits, RemotePolicy, aload_part, decode_image
from omnistage.media.source import too_large
from omnistage.media.video import write_mp4
from omnistage.types import OmniOutput, OmniRequest

if TYPE_CHECKING:
    from omnistage.entrypoints.async_omni import AsyncOmni

__all__ = ["VideoFields", "jobs_of", "router"]

log = logging.getLogger("omnistage.server")
router = APIRouter()
_SIZE = re.compile(r"^(\d+)x(\d+)$")
IMAGE_PART = "input_reference"
INT_FIELDS = ("width", "height", "num_frames", "fps", "num_inference_steps", "seed", "max_sequence_length")
FLOAT_FIELDS = ("seconds", "guidance_scale", "guidance_scale_2", "boundary_ratio", "flow_shift")
BOOL_FIELDS = ("vae_use_slicing", "vae_use_tiling")
# DiffusionParams fields a request may set as they are
PASSED = ("negative_prompt", "num_inference_steps", "guidance_scale", "guidance_scale_2", "boundary_ratio",
          "flow_shift", "seed", "max_sequence_length", "vae_use_slicing", "vae_use_tiling")


class VideoNotFound(RequestError):
    status = 404
    code = "video_not_found"


class VideoFields(BaseModel):
    """The generation fields of both POST routes; unknown fields are ignored, known ones are type-checked."""

    model_config = ConfigDict(strict=True, extra="ignore")

    prompt: str | None = None
    model: str | None = None
    negative_prompt: str | None = None
    size: str | None = None  # "WxH"
    width: int | None = Field(None, ge=1)
    height: int | None = Field(None, ge=1)
    seconds: float | None = Field(None, gt=0, le=3600)
    num_frames: int | None = Field(None, ge=1)
    fps: int | None = Field(None, ge=1, le=240)
    num_inference_steps: int | None = Field(None, ge=1, le=1000)
    guidance_scale: float | None = Field(None, ge=0)
    guidance_scale_2: float | None = Field(None, ge=0)
    boundary_ratio: float | None = Field(None, ge=0, le=1)
    flow_shift: float | None = Field(None, gt=0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    max_sequence_length: int | None = Field(None, ge=1)
    lora: LoraSpec | None = None
    vae_use_slicing: bool | None = None
    vae_use_tiling: bool | None = None

    @field_validator("seconds", mode="before")
    @classmethod
    def _seconds_text(cls, value: Any) -> Any:
        """OpenAI's `seconds` is a string ("4")."""
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise ValueError(f"seconds must be a number of seconds, e.g. '4' (got {value[:40]!r})") from None
        return value

    @classmethod
    def parse(cls, data: dict[str, Any]) -> VideoFields:
        """`data` with its `extra_body` merged in; a wrong type is a 400 naming the field."""
        return validated(cls, with_extra_body(data))

    def dimensions(self) -> tuple[int | None, int | None]:
        width, height = self.width, self.height
        if self.size is not None:
            match = _SIZE.match(self.size)
            if match is None:
                raise RequestError(f"size must be 'WIDTHxHEIGHT', e.g. '832x480' (got {self.size!r})", "size")
            w, h = int(match[1]), int(match[2])
            if (width or w) != w or (height or h) != h:
                raise RequestError(f"size {self.size!r} disagrees with width/height", "size")
            width, height = w, h
        return width, height

    def frames(self, pipeline: Any) -> int | None:
        """`num_frames`, or `seconds` at the request's (else the model's) fps, rounded to a count the model takes."""
        if self.seconds is None:
            return self.num_frames
        if self.num_frames is not None:
            raise RequestError("give either seconds or num_frames (with fps), not both", "seconds")
        fps = self.fps or getattr(pipeline, "defaults", {}).get("fps")
        if not fps:
            raise RequestError("this model has no default frame rate: give fps with seconds, or num_frames", "fps")
        return frames_for_seconds(pipeline, self.seconds, fps)

    def to_request(self, engine: AsyncOmni, request_id: str, image: Any = None) -> tuple[OmniRequest, DiffusionParams]:
        """The engine request and its params as the model resolves them, checked against the model up front."""
        if not self.prompt:
            raise RequestError("'prompt' is required: the text that describes the video", "prompt")
        pipeline = engine.pipeline
        if image is not None and not getattr(pipeline, "max_input_images", 0):
            raise RequestError("this model makes videos from text alone; leave input_reference out (an image-to-"
                               "video model, e.g. Wan2.2-I2V or -TI2V, animates an image)", IMAGE_PART)
        if image is None and getattr(pipeline, "min_input_images", 0):
            raise RequestError("this model animates an image: send it as input_reference (the video's first "
                               "frame)", IMAGE_PART)
        width, height = self.dimensions()
        given = {name: getattr(self, name) for name in PASSED if getattr(self, name) is not None}
        params = DiffusionParams(prompt=self.prompt, width=width, height=height, num_frames=self.frames(pipeline),
                                 fps=self.fps, lora=self.lora.as_params() if self.lora else None, **given).check()
        omni = OmniRequest(request_id, prompt=self.prompt, media={"image": [image]} if image is not None else {},
                           output_modalities=("video",), options={"diffusion": params})
        try:
            resolved = pipeline.request_params(omni)
        except RequestError as exc:
            if exc.param == "image":  # the families' name for it; this API calls it input_reference
                raise RequestError(exc.message, IMAGE_PART, exc.status) from None
            raise
        check_limits(pipeline.deploy.limits, resolved)
        return omni, resolved


def frames_for_seconds(pipeline: Any, seconds: float, fps: int) -> int:
    """The frame count nearest `seconds * fps` that the model takes: `1 + k * m` for a model whose frames must be
    one more than a multiple of `m` (`frame_multiple`: Wan's VAE keeps the first frame and compresses the rest m
    to 1), else any."""
    frames = max(1, round(seconds * fps))
    step = getattr(pipeline, "frame_multiple", None)
    if step:
        frames = 1 + max(0, round((frames - 1) / step)) * step
    return frames


def check_limits(limits: Any, params: DiffusionParams) -> None:
    """The output's pixels against the deploy config's limits (one frame; all frames)."""
    width, height, frames = params.width or 0, params.height or 0, params.num_frames or 1
    if width * height > limits.max_image_pixels:
        raise RequestError(f"size {width}x{height} has more pixels than the limit of {limits.max_image_pixels} "
                           "(limits.max_image_pixels)", "size")
    if frames * width * height > limits.max_video_pixels:
        raise RequestError(f"{frames} frames of {width}x{height} are more pixels than the limit of "
                           f"{limits.max_video_pixels} (limits.max_video_pixels); ask for fewer frames or a smaller "
                           "size", "num_frames")


# ---------------------------------------------------------------- reading a request


def _typed(name: str, text: str) -> Any:
    """A form field's text as its field's type; text that does not convert stays text, for the 400."""
    value = text.strip()
    if name in INT_FIELDS and re.fullmatch(r"[+-]?\d+", value):
        return int(value)
    if name in FLOAT_FIELDS:
        try:
            return float(value)
        except ValueError:
            return text
    if name in BOOL_FIELDS and value.lower() in ("true", "false"):
        return value.lower() == "true"
    return text


async def _read_upload(upload: UploadFile, limits: MediaLimits, budget: MediaBudget) -> bytes:
    if upload.size is not None and upload.size > limits.max_bytes:
        raise too_large(IMAGE_PART, limits.max_bytes, upload.size)
    data = await upload.read()
    if len(data) > limits.max_bytes:
        raise too_large(IMAGE_PART, limits.max_bytes, len(data))
    budget.spend(len(data), IMAGE_PART)
    return data


def _reference(value: Any) -> str | None:
    """An `input_reference` given as text or an object: the image's URL (a data URL or raw base64 too)."""
    if isinstance(value, str) and value.lstrip().startswith("{"):
        try:
            value = json.loads(value)
        except ValueError:
            raise RequestError("input_reference must be an image file, an image URL or {\"image_url\": URL}",
                               IMAGE_PART) from None
    if isinstance(value, dict):
        if value.get("file_id"):
            raise RequestError("input_reference by file_id is not supported: upload the image, or give "
                               "{\"image_url\": URL}", IMAGE_PART)
        value = value.get("image_url")
        value = value.get("url") if isinstance(value, dict) else value
    if isinstance(value, str) and value.strip():
        return value.strip()
    raise RequestError("input_reference must be an image file, an image URL or {\"image_url\": URL}", IMAGE_PART)


async def read_video_request(request: Request, engine: AsyncOmni) -> tuple[VideoFields, Any]:
    """The request's fields and its decoded input image (None without one), under the media limits."""
    deploy = engine.pipeline.deploy
    limits = MediaLimits.from_config(deploy.limits)
    budget = MediaBudget(limits.max_total_bytes)
    kind = request.headers.get("content-type", "").lower()
    data: dict[str, Any] = {}
    upload: bytes | None = None
    reference: Any = None
    if kind.startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
        try:
            form = await request.form(max_files=2, max_fields=256)
        except StarletteHTTPException as exc:
            raise RequestError(f"could not read the form: {exc.detail}", IMAGE_PART) from None
        try:
            for name, value in form.multi_items():
                if isinstance(value, UploadFile):
                    if name != IMAGE_PART or upload is not None:
                        raise RequestError(f"'{name}' must be a text field; the one file part is {IMAGE_PART}",
                                           name)
                    upload = await _read_upload(value, limits, budget)
                elif name == IMAGE_PART:
                    reference = value
                elif name == f"{IMAGE_PART}[image_url]":  # an object, as OpenAI's client sends it in a form
                    reference = {"image_url": value}
                elif name == f"{IMAGE_PART}[file_id]":
                    reference = {"file_id": value}
                else:
                    data[name] = _typed(name, value)
        finally:
            await form.close()
    else:
        try:
            data = await request.json()
        except ValueError:
            raise RequestError("send the request as multipart/form-data (curl -F prompt=...) or a JSON "
                               "object") from None
        if not isinstance(data, dict):
            raise RequestError("request body must be a JSON object")
        reference = data.pop(IMAGE_PART, None)
    fields = VideoFields.parse(data)
    image = None
    if upload is not None:
        image = await asyncio.to_thread(decode_image, upload, IMAGE_PART, limits.max_pixels)
    elif reference is not None:
        policy = getattr(engine, "media_policy", None) or RemotePolicy.from_config(deploy.media)
        part = {"type": "image_url", "image_url": {"url": _reference(reference)}}
        image = (await aload_part(part, IMAGE_PART, limits, policy=policy, budget=budget)).value
    return fields, image


def _video_engine(request: Request, model: str | None) -> tuple[AsyncOmni, str]:
    engine: AsyncOmni = request.app.state.engine
    name = check_model(request.app.state.model_names, model)
    if "video" not in engine.output_modalities:
        raise RequestError(f"this model does not generate video; it produces {list(engine.output_modalities)}",
                           "model")
    return engine, name


def _api_key(request: Request) -> str | None:
    """The key the request was let in with (BearerAuth checked it), or None on a server without keys."""
    if not request.app.state.edge.options.api_keys:
        return None
    return request.headers.get("authorization", "").strip().partition(" ")[2].strip()


def jobs_of(app: Any) -> VideoJobStore:
    """The app's job store, opened on first use (a restart's leftovers are marked then)."""
    store = getattr(app.state, "video_jobs", None)
    if store is None:
        from omnistage.entrypoints.openai.video_jobs import default_jobs_dir

        options = app.state.edge.options
        try:
            store = app.state.video_jobs = VideoJobStore(
                options.video_jobs_dir or default_jobs_dir(), options.video_jobs_max_bytes,
                options.video_jobs_max_age_s, options.max_video_jobs)
        except (RuntimeError, OSError) as exc:  # the directory is the operator's to fix; its path stays in the log
            log.error("video jobs are unavailable: %s", exc)
            raise OmniError("video jobs are unavailable: the server cannot open its jobs directory; the server log "
                            "has the details", status=503) from None
        app.state.video_tasks = {}
    return store


def _store(request: Request) -> VideoJobStore:
    _video_engine(request, None)  # a server without a video model keeps no jobs
    return jobs_of(request.app)


def _job(request: Request, video_id: str) -> VideoJob:
    job = _store(request).get(video_id, owner_of(_api_key(request)))
    if job is None:
        raise VideoNotFound(f"no video {video_id!r}: it does not exist, was deleted or has expired", "video_id")
    return job


# ---------------------------------------------------------------- running a job


def _video_of(out: OmniOutput, fallback_fps: float) -> tuple[Any, float]:
    if not out.videos:
        raise StageError("the model finished without a video; the server log has the details")
    return out.videos[0], float(out.fps or fallback_fps)


def _write(path: Any, out: OmniOutput, fallback_fps: float) -> None:
    frames, fps = _video_of(out, fallback_fps)
    write_mp4(path, frames, fps, out.audio, out.sample_rate)


async def _run_job(app: Any, job: VideoJob, omni: OmniRequest, release: Any) -> None:
    """One job, from the engine's first step to its mp4 on disk. Cancelled by DELETE (the job is already gone
    from the store) or by the server shutting down (then it is recorded as failed)."""
    store: VideoJobStore = app.state.video_jobs
    fan = Fanout(app.state.engine, [omni])
    try:
        await fan.start()
        store.start(job)
        merged = OmniOutput(omni.request_id)
        async for _, out in fan.events():
            raise_if_failed(out)
            merged.merge(out)
            if out.progress is not None:
                store.set_progress(job, *out.progress)
        await asyncio.to_thread(store.complete, job, partial(_write, out=merged, fallback_fps=job.fps))
    except asyncio.CancelledError:
        store.fail(job, "cancelled", "the server stopped before this video was done; submit the request again")
        raise
    except OmniError as exc:
        log.warning("video job %s failed (%s): %s", job.id, exc.status, exc.message)
        store.fail(job, getattr(exc, "code", None) or exc.type, exc.message)
    except Exception:
        log.exception("video job %s failed", job.id)
        store.fail(job, "internal_error", "internal server error; the server log has the details")
    finally:
        await fan.aclose()
        release()
        app.state.video_tasks.pop(job.id, None)


# ---------------------------------------------------------------- routes


@router.post("/v1/videos", response_model=None)
async def create_video(request: Request) -> JSONResponse:
    from omnistage.entrypoints.openai.server import Overloaded

    engine: AsyncOmni = request.app.state.engine
    _video_engine(request, None)  # a model without video is refused before its body is read
    fields, image = await read_video_request(request, engine)
    _, model = _video_engine(request, fields.model)
    job_id = new_job_id()
    omni, params = fields.to_request(engine, job_id, image)
    store = jobs_of(request.app)
    job = VideoJob(job_id, model, fields.prompt or "", f"{params.width}x{params.height}", params.num_frames or 1,
                   float(params.fps or 16), owner_of(_api_key(request)))
    release = request.app.state.edge.admit(1)  # 429 / 503 like every generation
    try:
        store.add(job)
    except JobsBusy as exc:
        release()
        raise Overloaded(str(exc)) from None
    task = asyncio.get_running_loop().create_task(_run_job(request.app, job, omni, release), name=job_id)
    request.app.state.video_tasks[job_id] = task  # held: the loop keeps only weak references to tasks
    return JSONResponse(job.describe(store.max_age_s))


@router.get("/v1/videos", response_model=None)
async def list_videos(request: Request, after: str | None = None, limit: int = 20,
                      order: Literal["asc", "desc"] = "desc") -> JSONResponse:
    if not 1 <= limit <= 100:
        raise RequestError(f"limit must be in [1, 100] (got {limit})", "limit")
    store = _store(request)
    jobs, more = store.list(owner_of(_api_key(request)), after, limit, order)
    data = [job.describe(store.max_age_s) for job in jobs]
    return JSONResponse({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                         "last_id": data[-1]["id"] if data else None, "has_more": more})


@router.get("/v1/videos/{video_id}", response_model=None)
async def retrieve_video(request: Request, video_id: str) -> JSONResponse:
    return JSONResponse(_job(request, video_id).describe(jobs_of(request.app).max_age_s))


@router.get("/v1/videos/{video_id}/content", response_model=None)
async def video_content(request: Request, video_id: str, variant: str = "video") -> Response:
    job = _job(request, video_id)
    if variant not in ("video", "thumbnail"):
        raise RequestError(f"variant {variant!r} is not available; this server serves 'video' (the mp4) and "
                           "'thumbnail' (its first frame, WebP)", "variant")
    if job.status != "completed":
        what = f"failed: {job.error['message']}" if job.error else f"{job.status}, {job.progress}% done"
        raise RequestError(f"{video_id} is not ready ({what}); poll GET /v1/videos/{video_id} until its status "
                           "is completed", "video_id", status=409 if job.status != "failed" else 400)
    path = jobs_of(request.app).video_path(job.id)
    if not path.is_file():  # removed by the size / age limits meanwhile
        raise VideoNotFound(f"the video of {video_id} has expired", "video_id")
    if variant == "thumbnail":
        from omnistage.media.video import video_thumbnail

        return Response(await asyncio.to_thread(video_thumbnail, path), media_type="image/webp")
    return FileResponse(path, media_type="video/mp4", filename=f"{job.id}.mp4")


@router.delete("/v1/videos/{video_id}", response_model=None)
async def delete_video(request: Request, video_id: str) -> JSONResponse:
    job = _job(request, video_id)
    jobs_of(request.app).delete(job.id)
    task = request.app.state.video_tasks.pop(job.id, None)
    if task is not None:  # running: cancelling it aborts its request in the engine; wait until that is sent
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return JSONResponse({"id": job.id, "object": "video.deleted", "deleted": True})


@router.post("/v1/videos/sync", response_model=None)
async def create_video_sync(request: Request) -> Response:
    engine: AsyncOmni = request.app.state.engine
    _video_engine(request, None)
    fields, image = await read_video_request(request, engine)
    _video_engine(request, fields.model)
    omni, params = fields.to_request(engine, f"videosync-{new_job_id()}", image)
    outputs = await run_admitted(request, [omni])
    if isinstance(outputs, Response):  # the client left: the generation was aborted
        return outputs
    from omnistage.media.video import encode_mp4

    frames, fps = _video_of(outputs[0], params.fps or 16)
    data = await asyncio.to_thread(encode_mp4, frames, fps, outputs[0].audio, outputs[0].sample_rate)
    return Response(data, media_type="video/mp4", headers={"Content-Disposition": 'attachment; filename="video.mp4"'})
