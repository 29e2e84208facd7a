"""Every environment variable omnistage reads, in one place: name, type, default, one line on what it does.

Read through the typed accessors below, at the moment they are needed (never cached at import), so a test
or a worker process that sets one before it starts sees it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EnvVar:
    name: str
    parse: Callable[[str], Any]
    default: Any
    doc: str

    def get(self) -> Any:
        raw = os.environ.get(self.name)
        return self.default if raw in (None, "") else self.parse(raw)


def _flag(raw: str) -> bool:
    return raw.strip().lower() not in ("0", "false", "no", "off")


FAMILY_PLUGINS = EnvVar("OMNISTAGE_FAMILY_PLUGINS", str, "",
                        "families outside omnistage, 'pkg.module:FamilyClass,...' (worker processes inherit it)")
API_KEY = EnvVar("OMNISTAGE_API_KEY", str, None, "default for `serve --api-key` and `bench serve --api-key`")
CACHE_DIR = EnvVar("OMNISTAGE_CACHE", str, None, "where tiny test/demo checkpoints are built (~/.cache/omnistage/tiny)")
TRITON_INTERPRET = EnvVar("TRITON_INTERPRET", _flag, False,
                          "Triton's own: kernels run in its interpreter (CPU tests); device-only launch features off")

LOG_STATS_INTERVAL_S = EnvVar("OMNISTAGE_LOG_STATS_INTERVAL_S", float, 10.0,
                              "seconds between the one-line load summaries in the log while busy; 0: none")
OPENAI_API_KEY = EnvVar("OPENAI_API_KEY", str, None,
                        "the openai SDK's own: `bench serve`'s key when neither --api-key nor OMNISTAGE_API_KEY is set")
VOICES_DIR = EnvVar("OMNISTAGE_VOICES_DIR", str, None, "where uploaded TTS voices are kept (`serve --voices-dir`; "
                    "default ~/.cache/omnistage/voices)")
RAY_ADDRESS = EnvVar("RAY_ADDRESS", str, None, "Ray's own: the cluster the ray backend joins (unset: starts one)")

REGISTRY: tuple[EnvVar, ...] = (FAMILY_PLUGINS, API_KEY, CACHE_DIR, TRITON_INTERPRET, LOG_STATS_INTERVAL_S,
                                OPENAI_API_KEY, VOICES_DIR, RAY_ADDRESS)
