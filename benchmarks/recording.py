"""One result row per measurement: printed as JSON and, with an output path, appended to a .jsonl file."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch

# The transformers baselines run transformers' own modules: its default Hub-kernel swap fetches kernels at load
# time, which the GPU machine (no network) cannot, and which omnistage's loads never do.
os.environ.setdefault("USE_HUB_KERNELS", "0")


def recorder(out: str | None) -> Callable[..., None]:
    """record(**row): tags the row with the device it ran on, prints it, appends it to `out` if given."""

    def record(**row) -> None:
        row["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        print(json.dumps(row), flush=True)
        if out:
            with open(out, "a") as f:
                f.write(json.dumps(row) + "\n")

    return record
