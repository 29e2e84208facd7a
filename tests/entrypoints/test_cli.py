"""The `omnistage` command line: fast --help with defaults (and never a key), API key sources, one-line
errors for what a user can fix."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from omnistage.entrypoints.cli import CAUSAL_LM_ARCHS, api_keys, build_parser
from omnistage.errors import ConfigError


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "omnistage", *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def test_help_is_fast_shows_defaults_and_hides_the_key() -> None:
    start = time.monotonic()
    proc = _cli("serve", "--help", env={"OMNISTAGE_API_KEY": "env-secret-key"})
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    for shown in ("(default: 127.0.0.1)", "(default: 8000)", "--shutdown-timeout-s S", "(default: 30.0)",
                  "--max-queued-requests", "--api-key-file", "--enable-docs", "--allowed-origins"):
        assert shown in text, shown
    assert "env-secret-key" not in proc.stdout
    assert elapsed < 3, f"--help took {elapsed:.1f} s"


def test_parsing_imports_nothing_heavy() -> None:
    """What keeps --help fast: torch and transformers load only once a command runs."""
    code = ("import sys; from omnistage.entrypoints.cli import build_parser; "
            "build_parser().parse_args(['serve', 'm']); print(sorted({'torch', 'transformers'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


def test_archs_match_the_factory() -> None:
    from omnistage.testing.factory import CAUSAL_LM_ARCHS as FACTORY_ARCHS

    assert CAUSAL_LM_ARCHS == FACTORY_ARCHS


def test_api_key_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# team keys\nfile-one\n\n  file-two  \n")
    parse = lambda *a: build_parser().parse_args(["serve", "m", *a])  # noqa: E731
    monkeypatch.setenv("OMNISTAGE_API_KEY", "from-env")
    assert api_keys(parse()) == ["from-env"]
    assert api_keys(parse("--api-key", "a", "--api-key", "b", "--api-key-file", str(keys))) == [
        "a", "b", "file-one", "file-two"]
    monkeypatch.delenv("OMNISTAGE_API_KEY")
    assert api_keys(parse()) == []
    with pytest.raises(ConfigError, match="cannot read"):
        api_keys(parse("--api-key-file", str(tmp_path / "missing")))
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(ConfigError, match="holds no key"):
        api_keys(parse("--api-key-file", str(tmp_path / "empty")))


def test_unreadable_key_file_is_one_line_error(tmp_path: Path) -> None:
    proc = _cli("serve", "some/model", "--api-key-file", str(tmp_path / "missing"))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --api-key-file"), proc.stderr


def test_chat_template_override_and_make_tiny_knows_every_layout(tiny_qwen2: str, tmp_path) -> None:
    from omnistage.entrypoints.cli import TINY_ARCHS, override_chat_template
    from omnistage.errors import ConfigError
    from omnistage.families.registry import load_pipeline
    from omnistage.types import OmniRequest

    pipeline = load_pipeline(tiny_qwen2)
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}")
    override_chat_template(pipeline, str(template))
    ids = pipeline.tokenize(OmniRequest(messages=[{"role": "user", "content": "hi"}]))
    assert pipeline.tokenizer.decode(ids) == "<<hi>>"
    with pytest.raises(ConfigError, match="neither a file nor a Jinja template"):
        override_chat_template(pipeline, "no-such-file.jinja")
    assert {"qwen2", "qwen2_5_omni", "flux-dev", "flux-schnell"} <= set(TINY_ARCHS)
