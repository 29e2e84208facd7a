"""Shared fixtures. Tests never touch a model hub: tiny checkpoints are built locally and cached."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
# References run transformers' own modules (its default swap for Hub kernels would fetch them at load time).
os.environ["USE_HUB_KERNELS"] = "0"
# Without a GPU, Triton kernels run in Triton's interpreter (must be set before triton is imported).
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Tiny models on a 2-core machine: several stage threads (and worker processes, via the environment)
# each spinning up intra-op threads only fight over the cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

from omnistage.testing import tiny_checkpoint  # noqa: E402
from omnistage.testing.factory import CAUSAL_LM_ARCHS  # noqa: E402

TINY_ARCHS = list(CAUSAL_LM_ARCHS)


@pytest.fixture(scope="session")
def tiny_qwen2() -> str:
    return str(tiny_checkpoint("qwen2"))


@pytest.fixture(scope="session")
def tiny_qwen3() -> str:
    return str(tiny_checkpoint("qwen3"))


@pytest.fixture(scope="session")
def tiny_llama() -> str:
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="session")
def tiny_qwen2_5_omni() -> str:
    """Tiny random Qwen2.5-Omni (thinker, talker, token2wav, processor files, voices Chelsie and Ethan)."""
    return str(tiny_checkpoint("qwen2_5_omni"))


@pytest.fixture(scope="session", params=TINY_ARCHS)
def tiny_lm(request: pytest.FixtureRequest) -> str:
    """Parametrized over every tiny architecture; tests using it run once per arch."""
    return str(tiny_checkpoint(request.param))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fuzz-requests", type=int, default=1000,
                     help="mutated requests the reliability fuzz sends to the causal-LM server (a quarter, at least "
                     "200, to Qwen2.5-Omni)")


@pytest.fixture
def fuzz_requests(request: pytest.FixtureRequest) -> int:
    return request.config.getoption("--fuzz-requests")
