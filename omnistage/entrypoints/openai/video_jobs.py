"""The video jobs of `/v1/videos`: one small JSON record per job and its mp4, in one directory.

Layout: `<id>.json` (the record, rewritten atomically on every status change) and `<id>.mp4` (a completed job's
video, written as `<id>.mp4.part` and renamed, so a file under the final name is always whole). Progress lives in
memory only; a record on disk is at most one status behind.

Invariants:
- One server owns a directory at a time (an exclusive `flock` on `.lock`, released by the OS when the process
  dies): opening a directory another live server holds fails, so a restart may mark the records it finds
  unfinished (queued, in_progress) failed: their server is gone and nobody will finish them. No job is lost
  silently.
- Ids are `video_` + 128 random bits (`secrets`); an id that is not of that shape never reaches the filesystem.
- A job belongs to the API key that created it (a hash of it is kept, never the key): any other owner is told
  it does not exist.
- Cleanup removes whole finished jobs (record and file): any older than `max_age_s`, then the oldest completed
  ones while the videos add up to more than `max_bytes` (the newest video is always kept, so one video larger
  than the limit still reaches its client).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import secrets
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

log = logging.getLogger("omnistage.server")

__all__ = ["JobsBusy", "VideoJob", "VideoJobStore", "default_jobs_dir", "new_job_id", "owner_of"]

Status = Literal["queued", "in_progress", "completed", "failed"]
FINISHED = ("completed", "failed")
ID = re.compile(r"^video_[0-9a-f]{32}$")
RESTARTED = {"code": "server_restarted",
             "message": "the server stopped before this video was done; submit the request again"}


def default_jobs_dir() -> Path:
    """`<system temp dir>/omnistage-videos-<uid>`: per user, so two users' servers never share one."""
    return Path(tempfile.gettempdir()) / f"omnistage-videos-{os.getuid()}"


def new_job_id() -> str:
    return f"video_{secrets.token_hex(16)}"


def owner_of(api_key: str | None) -> str | None:
    """What a record keeps of the key that created it: a hash (None without API keys)."""
    return None if api_key is None else hashlib.sha256(api_key.encode()).hexdigest()[:32]


class JobsBusy(Exception):
    """The store is at its limit of unfinished jobs."""


@dataclass
class VideoJob:
    id: str
    model: str
    prompt: str
    size: str  # "WxH" of the video it makes
    num_frames: int
    fps: float
    owner: str | None = None
    status: Status = "queued"
    progress: int = 0  # percent
    created_ns: int = field(default_factory=time.time_ns)  # orders the list (created_at has whole seconds)
    created_at: int = 0
    completed_at: int | None = None
    error: dict[str, Any] | None = None  # {"code", "message"} of a failed job
    bytes: int = 0  # the mp4's size on disk

    def __post_init__(self) -> None:
        self.created_at = self.created_at or self.created_ns // 10**9

    @property
    def seconds(self) -> str:
        return f"{self.num_frames / self.fps:.2f}".rstrip("0").rstrip(".")

    @property
    def finished(self) -> bool:
        return self.status in FINISHED

    def describe(self, max_age_s: float | None = None) -> dict[str, Any]:
        """OpenAI's video object, plus the frame count and rate it was made with."""
        expires = None
        if self.status == "completed" and max_age_s is not None and self.completed_at is not None:
            expires = int(self.completed_at + max_age_s)
        return {"id": self.id, "object": "video", "model": self.model, "status": self.status,
                "progress": self.progress, "created_at": self.created_at, "completed_at": self.completed_at,
                "expires_at": expires, "error": self.error, "prompt": self.prompt, "seconds": self.seconds,
                "size": self.size, "remixed_from_video_id": None, "num_frames": self.num_frames, "fps": self.fps}

    @classmethod
    def read(cls, path: Path) -> VideoJob | None:
        try:
            data = json.loads(path.read_text())
            known = {f.name for f in fields(cls)}
            job = cls(**{k: v for k, v in data.items() if k in known})
        except (OSError, ValueError, TypeError):
            log.warning("skipping an unreadable video job record: %s", path)
            return None
        return job if ID.match(job.id) and path.stem == job.id else None


class VideoJobStore:
    """The jobs of one directory, indexed in memory and written through. Its methods run on the server's event
    loop, and the file writes of a finishing job in a worker thread: a lock guards the index."""

    def __init__(self, directory: str | Path, max_bytes: int = 10 * 2**30, max_age_s: float = 86400.0,
                 max_active: int = 16) -> None:
        self.directory = Path(directory).expanduser()
        self.max_bytes, self.max_age_s, self.max_active = max_bytes, max_age_s, max_active
        self.lock = threading.Lock()
        self.jobs: dict[str, VideoJob] = {}
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._lock_file = open(self.directory / ".lock", "a+")  # noqa: SIM115 (held until close)
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            raise RuntimeError(f"the video jobs directory {self.directory} is in use by another omnistage server; "
                               "give each server its own (--video-jobs-dir)") from None
        self._load()

    def _load(self) -> None:
        for path in self.directory.glob("*.part"):  # an encode the last server did not finish
            path.unlink(missing_ok=True)
        for path in sorted(self.directory.glob("video_*.json")):
            job = VideoJob.read(path)
            if job is None:
                continue
            if not job.finished:
                job.status, job.error, job.completed_at = "failed", dict(RESTARTED), int(time.time())
                self._write(job)
            if job.status == "completed" and not self.video_path(job.id).is_file():
                job.status, job.error = "failed", {"code": "video_missing", "message": "the video file is gone"}
                self._write(job)
            self.jobs[job.id] = job
        for path in self.directory.glob("video_*.mp4"):  # a video without its record
            if path.stem not in self.jobs:
                path.unlink(missing_ok=True)
        self.sweep()

    def close(self) -> None:
        """Releases the directory (the process ending does it too)."""
        if not self._lock_file.closed:
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
            self._lock_file.close()

    # ------------------------------------------------------------ files

    def record_path(self, job_id: str) -> Path:
        return self.directory / f"{job_id}.json"

    def video_path(self, job_id: str) -> Path:
        return self.directory / f"{job_id}.mp4"

    def _write(self, job: VideoJob) -> None:
        tmp = self.directory / f".{job.id}.json.tmp"
        tmp.write_text(json.dumps(asdict(job)))
        tmp.replace(self.record_path(job.id))  # atomic: a crash leaves the old record or the new one

    def _remove(self, job_id: str) -> None:
        for path in (self.video_path(job_id), self.record_path(job_id), self.directory / f"{job_id}.mp4.part"):
            path.unlink(missing_ok=True)

    # ------------------------------------------------------------ jobs

    def active(self) -> int:
        with self.lock:
            return sum(not job.finished for job in self.jobs.values())

    def add(self, job: VideoJob) -> VideoJob:
        """Records a new queued job; JobsBusy when `max_active` jobs are unfinished."""
        self.sweep()
        with self.lock:
            if sum(not j.finished for j in self.jobs.values()) >= self.max_active:
                raise JobsBusy(f"the server is at its limit of {self.max_active} unfinished video jobs; "
                               "retry when one has finished")
            self.jobs[job.id] = job
        self._write(job)
        return job

    def get(self, job_id: str, owner: str | None) -> VideoJob | None:
        """The job, if it exists and belongs to `owner`."""
        if not ID.match(job_id):
            return None
        self.sweep()
        with self.lock:
            job = self.jobs.get(job_id)
        return job if job is not None and job.owner == owner else None

    def list(self, owner: str | None, after: str | None = None, limit: int = 20,
             order: Literal["asc", "desc"] = "desc") -> tuple[list[VideoJob], bool]:
        """`owner`'s jobs by creation time (newest first for "desc"), starting after the job `after`; and whether
        more follow."""
        self.sweep()
        with self.lock:
            jobs = [j for j in self.jobs.values() if j.owner == owner]
        jobs.sort(key=lambda j: j.created_ns, reverse=order == "desc")
        if after is not None:
            ids = [j.id for j in jobs]
            jobs = jobs[ids.index(after) + 1:] if after in ids else []
        return jobs[:limit], len(jobs) > limit

    def start(self, job: VideoJob) -> None:
        if job.status == "queued":
            job.status = "in_progress"
            self._persist(job)

    def set_progress(self, job: VideoJob, done: int, total: int) -> None:
        """Percent of the denoising steps done, at most 99 until the video is written."""
        if total > 0:
            job.progress = max(job.progress, min(99, done * 100 // total))

    def complete(self, job: VideoJob, write: Any) -> None:
        """`write(path)` writes the video (in a worker thread); the job is completed once it is there whole."""
        part = self.directory / f"{job.id}.mp4.part"
        write(part)
        with self.lock:
            if job.id not in self.jobs:  # deleted meanwhile
                part.unlink(missing_ok=True)
                return
            part.replace(self.video_path(job.id))
            job.status, job.progress, job.completed_at = "completed", 100, int(time.time())
            job.bytes = self.video_path(job.id).stat().st_size
        self._persist(job)
        self.sweep()

    def fail(self, job: VideoJob, code: str, message: str) -> None:
        job.status, job.error, job.completed_at = "failed", {"code": code, "message": message}, int(time.time())
        self._persist(job)

    def _persist(self, job: VideoJob) -> None:
        with self.lock:
            if job.id not in self.jobs:  # deleted: leave no record behind
                return
            self._write(job)

    def delete(self, job_id: str) -> VideoJob | None:
        """Removes the job and its files (the caller cancels its generation)."""
        with self.lock:
            job = self.jobs.pop(job_id, None)
            if job is not None:
                self._remove(job_id)
        return job

    def sweep(self, now: float | None = None) -> list[str]:
        """Removes expired finished jobs, then the oldest completed ones beyond `max_bytes`; their ids."""
        now = time.time() if now is None else now
        removed = []
        with self.lock:
            done = sorted((j for j in self.jobs.values() if j.finished),
                          key=lambda j: (j.completed_at or j.created_at, j.created_at))
            for job in done:
                if now - (job.completed_at or job.created_at) > self.max_age_s:
                    removed.append(job.id)
            videos = [j for j in done if j.status == "completed" and j.id not in removed]
            total = sum(j.bytes for j in videos)
            for job in videos[:-1]:  # the newest stays
                if total <= self.max_bytes:
                    break
                total -= job.bytes
                removed.append(job.id)
            for job_id in removed:
                del self.jobs[job_id]
                self._remove(job_id)
        if removed:
            log.info("removed %d finished video jobs (age / size limits)", len(removed))
        return removed
