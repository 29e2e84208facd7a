"""`omnistage demo --arch wan2_2` end to end: a tiny Wan2.2 checkpoint served in a fresh process, one clip through
POST /v1/videos/sync, the mp4 decoded."""

from __future__ import annotations

import subprocess
import sys


def test_demo_writes_a_video(tmp_path) -> None:
    """`omnistage demo --arch wan2_2`: the tiny TI2V checkpoint served, one clip through POST /v1/videos/sync."""
    import av

    out = tmp_path / "demo.mp4"
    proc = subprocess.run([sys.executable, "-m", "omnistage", "demo", "--arch", "wan2_2", "--video-out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"wrote {out}" in proc.stdout
    with av.open(str(out)) as container:
        stream = container.streams.video[0]
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
        assert float(stream.average_rate) == 8
    assert len(frames) == 9 and frames[0].shape == (64, 64, 3)
