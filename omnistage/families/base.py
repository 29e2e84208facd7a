"""What a family declares: the stages of its pipeline, the edges between them, and how a
request enters (preprocess) and leaves (to_output). Topology lives here, in code."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

from omnistage.config.deploy import DeployConfig, StageConfig
from omnistage.engine.base import Engine
from omnistage.errors import RequestError
from omnistage.types import OmniOutput, OmniRequest, StageInput, StageOutput

# transformers' from_pretrained swaps layers for Hub kernels by default, fetched at load time: offline machines
# fail, and the modules would no longer be the ones the parity tests pin. Every transformers model load passes this.
TRANSFORMERS_LOAD: dict[str, Any] = {"use_kernels": False}

# Turns stage i's output (a delta, or the merged whole when not streaming) into stage j's input.
Handoff = Callable[[OmniRequest, StageOutput], "StageInput | None"]


@dataclass
class StageSpec:
    name: str
    kind: str  # "ar" | "diffusion" | "generation"
    outputs: tuple[str, ...] = ()  # modalities this stage delivers to the caller


@dataclass
class Edge:
    src: str
    dst: str
    handoff: Handoff
    # With the deploy config's `async_chunk`, a streamed edge's handoff sees every delta as it is made
    # (and opens the downstream request early); otherwise it sees the whole output once, at the end.
    streamed: bool = True


@dataclass
class Pipeline:
    """A family's stage graph for one checkpoint. `stages[0]` is the entry stage."""

    model_path: Path
    deploy: DeployConfig
    stages: list[StageSpec]
    edges: list[Edge] = field(default_factory=list)
    tokenizer: Any = None  # entry stage's tokenizer, if it has one
    max_model_len: int = 0  # entry stage's context length
    audio_sample_rate: ClassVar[int | None] = None  # the rate of the audio it outputs, if it outputs audio
    input_modalities: ClassVar[tuple[str, ...]] = ("text",)  # what a request's messages may carry
    serves_embeddings: ClassVar[bool] = False  # preprocess honours options["embed"] (a pooled prompt, no text)

    @property
    def entry(self) -> str:
        return self.stages[0].name

    @property
    def output_modalities(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(m for s in self.stages for m in s.outputs))

    def stage_config(self, name: str) -> StageConfig:
        return self.deploy.stage(name)

    def route(self, modalities: tuple[str, ...]) -> list[str]:
        """Stages a request asking for `modalities` must run: those producing them and their
        upstream stages."""
        needed = {s.name for s in self.stages if set(s.outputs) & set(modalities)}
        changed = True
        while changed:
            before = len(needed)
            needed |= {e.src for e in self.edges if e.dst in needed}
            changed = len(needed) != before
        return [s.name for s in self.stages if s.name in needed]

    def transcription_messages(self, audio: Any, task: str, language: str | None = None,
                               prompt: str | None = None) -> list[dict[str, Any]]:
        """The chat messages that make the entry stage write what `audio` (mono float32 at 16 kHz) says: `task`
        "transcribe" (in its own language) or "translate" (into English); `language` names the spoken language
        when the caller knows it, `prompt` is text to follow (earlier speech, spellings). A family whose model
        was trained on its own instruction or system prompt overrides this. Only models that hear serve it."""
        if "audio" not in self.input_modalities:
            raise RequestError("this model does not take audio input; serve a model that hears (e.g. Qwen2.5-Omni)",
                               "model")
        said = f" The audio is in {language}." if language else ""
        instruction = ("Translate the audio into English text." if task == "translate"
                       else "Transcribe the audio into text.") + said
        if prompt:
            instruction += f" Follow the style and spellings of this text, which may precede the audio: {prompt}"
        instruction += " Reply with the text only."
        content = [{"type": "audio", "audio": audio}, {"type": "text", "text": instruction}]
        return [{"role": "user", "content": content}]

    # Family-specific behaviour; subclasses override.
    def preprocess(self, request: OmniRequest) -> StageInput:
        raise NotImplementedError

    def build_engine(self, stage: str, device: str | None = None) -> Engine:
        raise NotImplementedError

    def to_output(self, stage: str, out: StageOutput) -> OmniOutput:
        """What the caller sees of one output stage's delta (text, audio, images)."""
        return OmniOutput(
            request_id=out.request_id,
            text=out.text,
            token_ids=out.token_ids,
            logprobs=out.logprobs,
            num_prompt_tokens=out.num_prompt_tokens,
            num_cached_tokens=out.num_cached_tokens,
            num_output_tokens=out.num_output_tokens,
        )


@dataclass
class CheckpointInfo:
    """The checkpoint's self-description: config.json (transformers) or model_index.json (diffusers)."""

    path: Path
    config: dict[str, Any] | None = None
    model_index: dict[str, Any] | None = None

    @classmethod
    def read(cls, path: Path) -> CheckpointInfo:
        def load(name: str) -> dict[str, Any] | None:
            file = path / name
            return json.loads(file.read_text()) if file.is_file() else None

        return cls(path, load("config.json"), load("model_index.json"))

    @property
    def architectures(self) -> list[str]:
        return list((self.config or {}).get("architectures") or [])

    @property
    def class_name(self) -> str | None:
        return (self.model_index or {}).get("_class_name")


class Family(Protocol):
    name: str

    def matches(self, info: CheckpointInfo) -> bool: ...

    def pipeline(self, info: CheckpointInfo, deploy: DeployConfig) -> Pipeline: ...

    def default_deploy(self, info: CheckpointInfo) -> dict[str, Any]:
        """Family defaults under the user's deploy config (e.g. hidden-state layers, windows)."""
        ...
