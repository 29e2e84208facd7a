"""The /v1/videos job store on real files: records persist and a new store (a restarted server) reads them,
marking the unfinished ones failed; one store per directory; cleanup by age and by size removes the oldest
finished jobs and their files; ownership; the unfinished-jobs limit; ids are random and checked."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from omnistage.entrypoints.openai.video_jobs import (
    RESTARTED,
    JobsBusy,
    VideoJob,
    VideoJobStore,
    new_job_id,
    owner_of,
)


def job(owner: str | None = None, **kw) -> VideoJob:
    return VideoJob(new_job_id(), "wan", "a fox", "64x32", 9, 8.0, owner, **kw)


def finish(store: VideoJobStore, j: VideoJob, size: int = 100) -> None:
    store.start(j)
    store.complete(j, lambda path: Path(path).write_bytes(b"v" * size))


@pytest.fixture
def store(tmp_path: Path):
    s = VideoJobStore(tmp_path / "jobs")
    yield s
    s.close()


def test_ids_are_random_and_checked(store: VideoJobStore) -> None:
    ids = {new_job_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(i.startswith("video_") and len(i) == 38 for i in ids)
    for bad in ("../../etc/passwd", "video_" + "g" * 32, "video_abc", ""):
        assert store.get(bad, None) is None


def test_lifecycle_on_disk(store: VideoJobStore) -> None:
    j = store.add(job())
    record = json.loads(store.record_path(j.id).read_text())
    assert record["status"] == "queued" and record["id"] == j.id
    store.start(j)
    store.set_progress(j, 3, 4)
    assert j.progress == 75 and json.loads(store.record_path(j.id).read_text())["status"] == "in_progress"
    store.set_progress(j, 4, 4)
    assert j.progress == 99  # 100 only once the video is written
    store.complete(j, lambda path: Path(path).write_bytes(b"mp4 bytes"))
    assert j.status == "completed" and j.progress == 100 and j.bytes == 9
    assert store.video_path(j.id).read_bytes() == b"mp4 bytes"
    assert not list(store.directory.glob("*.part"))
    described = j.describe(store.max_age_s)
    assert described["object"] == "video" and described["seconds"] == "1.12" and described["size"] == "64x32"
    assert described["expires_at"] == j.completed_at + int(store.max_age_s)
    assert store.delete(j.id) is j
    assert not store.record_path(j.id).exists() and not store.video_path(j.id).exists()
    assert store.get(j.id, None) is None


def test_restart_marks_unfinished_failed(tmp_path: Path) -> None:
    first = VideoJobStore(tmp_path)
    queued, running, done, failed = (first.add(job()) for _ in range(4))
    first.start(running)
    finish(first, done)
    first.fail(failed, "stage_error", "the DiT failed")
    (tmp_path / f"{queued.id}.mp4.part").write_bytes(b"half")  # an encode cut short
    (tmp_path / f"{new_job_id()}.mp4").write_bytes(b"orphan")  # a video whose record is gone
    first.close()  # as the OS does when the process dies: nothing else is written
    second = VideoJobStore(tmp_path)
    try:
        for old in (queued, running):
            again = second.get(old.id, None)
            assert again.status == "failed" and again.error == RESTARTED
            assert json.loads(second.record_path(old.id).read_text())["status"] == "failed"
        assert second.get(done.id, None).status == "completed"
        assert second.video_path(done.id).read_bytes() == b"v" * 100
        assert second.get(failed.id, None).error == {"code": "stage_error", "message": "the DiT failed"}
        assert sorted(p.name for p in tmp_path.glob("*.mp4*")) == [f"{done.id}.mp4"]
        assert [j.id for j in second.list(None)[0]] == [failed.id, done.id, running.id, queued.id]
    finally:
        second.close()


def test_a_completed_job_without_its_file_fails(tmp_path: Path) -> None:
    first = VideoJobStore(tmp_path)
    done = first.add(job())
    finish(first, done)
    first.close()
    first.video_path(done.id).unlink()
    second = VideoJobStore(tmp_path)
    assert second.get(done.id, None).status == "failed"
    second.close()


def test_one_store_per_directory(tmp_path: Path) -> None:
    first = VideoJobStore(tmp_path)
    with pytest.raises(RuntimeError, match="in use by another omnistage server"):
        VideoJobStore(tmp_path)
    first.close()
    VideoJobStore(tmp_path).close()


def test_unreadable_records_are_skipped(tmp_path: Path) -> None:
    (tmp_path / f"{new_job_id()}.json").write_text("{not json")
    other = job()
    (tmp_path / f"{new_job_id()}.json").write_text(json.dumps({**other.__dict__}))  # id and file name differ
    s = VideoJobStore(tmp_path)
    assert s.jobs == {}
    s.close()


def test_cleanup_by_age(tmp_path: Path) -> None:
    s = VideoJobStore(tmp_path, max_age_s=60)
    old, new, running = s.add(job()), s.add(job()), s.add(job())
    finish(s, old)
    finish(s, new)
    s.start(running)
    old.completed_at -= 120
    assert s.sweep() == [old.id]
    assert not s.video_path(old.id).exists() and not s.record_path(old.id).exists()
    assert s.get(new.id, None) is not None
    running.created_at -= 1000
    assert s.sweep() == [] and s.get(running.id, None) is not None  # unfinished jobs never expire
    assert s.sweep(now=time.time() + 61) == [new.id]
    s.close()


def test_cleanup_by_size_removes_the_oldest(tmp_path: Path) -> None:
    s = VideoJobStore(tmp_path, max_bytes=250)
    a, b, c = s.add(job()), s.add(job()), s.add(job())
    now = int(time.time())
    for j, ago in ((a, 30), (b, 20), (c, 10)):
        finish(s, j)
        j.completed_at = now - ago  # oldest first: a, b, c
    s.sweep()
    assert s.get(a.id, None) is None and s.get(b.id, None) is not None  # 200 bytes in all again
    assert not s.video_path(a.id).exists()
    big = s.add(job())
    finish(s, big, size=1000)  # larger than the limit alone: the newest stays, every older one goes
    assert [j.id for j in s.list(None)[0]] == [big.id]
    s.close()


def test_ownership(store: VideoJobStore) -> None:
    alice, bob = owner_of("key-alice"), owner_of("key-bob")
    assert alice != bob and "key-alice" not in alice
    mine = store.add(job(alice))
    store.add(job(bob))
    assert store.get(mine.id, alice) is mine
    assert store.get(mine.id, bob) is None and store.get(mine.id, None) is None
    assert [j.id for j in store.list(alice)[0]] == [mine.id]
    assert "key-alice" not in store.record_path(mine.id).read_text()


def test_unfinished_limit(tmp_path: Path) -> None:
    s = VideoJobStore(tmp_path, max_active=2)
    first, _ = s.add(job()), s.add(job())
    with pytest.raises(JobsBusy, match="limit of 2 unfinished"):
        s.add(job())
    s.fail(first, "cancelled", "gone")
    s.add(job())
    s.close()


def test_list_order_and_pages(store: VideoJobStore) -> None:
    jobs = [store.add(job()) for _ in range(5)]
    page, more = store.list(None, limit=2)
    assert [j.id for j in page] == [jobs[4].id, jobs[3].id] and more
    page, more = store.list(None, after=page[-1].id, limit=2)
    assert [j.id for j in page] == [jobs[2].id, jobs[1].id] and more
    page, more = store.list(None, after=page[-1].id, limit=2)
    assert [j.id for j in page] == [jobs[0].id] and not more
    assert [j.id for j in store.list(None, order="asc")[0]] == [j.id for j in jobs]
    assert store.list(None, after=new_job_id()) == ([], False)


def test_delete_during_the_encode(store: VideoJobStore) -> None:
    """A job deleted while its video is written leaves neither the file nor a record."""
    j = store.add(job())

    def write(path) -> None:
        Path(path).write_bytes(b"late")
        store.delete(j.id)

    store.complete(j, write)
    assert list(store.directory.glob("video_*")) == []
