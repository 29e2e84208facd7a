"""omnistage: serve any-to-any multimodal models behind an OpenAI-compatible API."""

from omnistage.sampling_params import SamplingParams

__all__ = ["SamplingParams", "Omni", "AsyncOmni", "OmniRequest", "OmniOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Entry points pull in torch and transformers; import them only when asked for.
    if name == "Omni":
        from omnistage.entrypoints.omni import Omni

        return Omni
    if name == "AsyncOmni":
        from omnistage.entrypoints.async_omni import AsyncOmni

        return AsyncOmni
    if name in ("OmniRequest", "OmniOutput"):
        from omnistage import types

        return getattr(types, name)
    raise AttributeError(name)
