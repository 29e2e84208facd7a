"""Without a deploy config, Qwen2.5-Omni serves the way its shipped 1gpu.yaml says (2gpu.yaml's split where two
or more GPUs are visible; on a host without GPUs the same, with every stage on the CPU in float32)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import yaml

from omnistage.families.qwen2_5_omni import (
    CONFIGS,
    TALKER_TUNED,
    Token2WavAdvanced,
    Token2WavOptions,
    dit_dtype,
    models,
)
from omnistage.families.registry import load_pipeline as build_pipeline

pytest.importorskip("torchvision", reason="Qwen2.5-Omni's processor needs torchvision (installed by scripts/test)")
STAGES = ("thinker", "talker", "token2wav")


def shipped(name: str) -> dict:
    return yaml.safe_load((CONFIGS / name).read_text())


def without(fields: tuple[str, ...], config: dict) -> dict:
    stages = {name: {f: v for f, v in stage.items() if f not in fields} for name, stage in config["stages"].items()}
    return {**config, "stages": stages}


@pytest.mark.parametrize(("gpus", "name"), [(1, "1gpu.yaml"), (2, "2gpu.yaml"), (4, "2gpu.yaml")])
def test_the_defaults_are_the_shipped_config(tiny_qwen2_5_omni: str, monkeypatch, gpus: int, name: str) -> None:
    """The default is the packaged YAML itself, not a copy of its values: every stage field it sets, as it sets
    it (the token2wav DiT in bfloat16 on GPUs). A deploy config still wins."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    deploy = build_pipeline(tiny_qwen2_5_omni).deploy
    config = shipped(name)
    assert (deploy.worker_backend, deploy.async_chunk) == (config["worker_backend"], config["async_chunk"]) == (
        "inline", True)
    for stage, fields in config["stages"].items():
        assert deploy.stage(stage).model_dump(include=set(fields)) == fields, stage
    assert deploy.stage("token2wav").dtype == "bfloat16" and deploy.stage("thinker").dtype == "auto"
    assert deploy.stage("talker").sampling_params().max_tokens == 3000  # speaks until its end code, a minute at most
    one = build_pipeline(tiny_qwen2_5_omni, CONFIGS / "1gpu.yaml").deploy
    assert {one.stage(name).devices for name in STAGES} == {"0"}
    exact = build_pipeline(tiny_qwen2_5_omni, overrides={"stages.token2wav.dtype": "float32"}).deploy
    assert exact.stage("token2wav").dtype == "float32"


def test_without_gpus_the_default_runs_every_stage_on_the_cpu(tiny_qwen2_5_omni: str, monkeypatch) -> None:
    """1gpu.yaml less what names a GPU or a GPU precision (`devices`, `dtype`): resolved, every stage is the CPU's
    and token2wav's DiT is float32."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    deploy = build_pipeline(tiny_qwen2_5_omni).deploy
    config = without(("devices", "dtype"), shipped("1gpu.yaml"))
    for stage, fields in config["stages"].items():
        assert deploy.stage(stage).model_dump(include=set(fields)) == fields, stage
    assert all((deploy.stage(s).devices, deploy.stage(s).dtype) == (None, "auto") for s in STAGES)
    assert dit_dtype("auto", torch.device("cpu")) == torch.float32
    assert dit_dtype("auto", torch.device("cuda:0")) == torch.bfloat16
    assert dit_dtype("float32", torch.device("cuda:0")) == torch.float32


def test_internal_tuning_has_family_defaults_outside_the_yaml() -> None:
    """The shipped configs hold user settings only; the talker's decode bursts and token2wav's solve tuning are
    the family's defaults, reachable through `advanced`."""
    for name in ("1gpu.yaml", "2gpu.yaml"):
        assert not any("advanced" in stage for stage in shipped(name)["stages"].values())
    assert TALKER_TUNED == {"decode_burst": 8}
    tuned = Token2WavAdvanced()
    assert (tuned.cublas_sm_carveout, tuned.carveout_max_batch, tuned.vocoder_context) == (32, 2, 16)
    assert Token2WavOptions.model_fields["vocoder_dtype"].annotation.__args__ == models.VOCODER_DTYPES


def forget_warnings() -> None:
    """transformers' `Logger.warning_once` is an lru_cache unless a library imported earlier replaced it."""
    getattr(logging.Logger.warning_once, "cache_clear", lambda: None)()


def test_its_pipeline_loads_without_false_vocabulary_warnings(tiny_qwen2_5_omni: str) -> None:
    """transformers flags the thinker's token ids that the talker's config carries as outside the talker's (codec)
    vocabulary, for every Qwen2.5-Omni checkpoint; building the pipeline drops those warnings, and only them."""
    from transformers import Qwen2_5OmniConfig

    class Seen(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.messages: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.messages.append(record.getMessage())

    seen, config_logger = Seen(), logging.getLogger("transformers.configuration_utils")
    config_logger.addHandler(seen)
    level = config_logger.level
    config_logger.setLevel(logging.WARNING)  # libraries imported by earlier tests may have quietened it
    try:
        forget_warnings()  # transformers says each warning once a process
        build_pipeline(tiny_qwen2_5_omni)
        assert not [m for m in seen.messages if "within the vocabulary" in m]
        forget_warnings()
        Qwen2_5OmniConfig.from_pretrained(tiny_qwen2_5_omni)  # the same load outside the pipeline: flagged
        assert any("tts_text_pad_token_id" in m and "within the vocabulary" in m for m in seen.messages)
        seen.messages.clear()
        forget_warnings()
        with models.thinker_ids_unflagged():  # any other id out of its vocabulary is still reported
            Qwen2_5OmniConfig.from_pretrained(tiny_qwen2_5_omni, talker_config={"pad_token_id": 10**6})
        flagged = [m for m in seen.messages if "within the vocabulary" in m]
        assert flagged and all(m.startswith("Model config: pad_token_id") for m in flagged)
    finally:
        config_logger.removeHandler(seen)
        config_logger.setLevel(level)


def test_a_users_options_replace_the_defaults_they_name(tiny_qwen2_5_omni: str) -> None:
    """Setting only `window` keeps the other defaults (`max_window`; below `window` it is no limit) and the
    first chunk at its own default (24 codes, or the window if smaller)."""
    deploy = build_pipeline(tiny_qwen2_5_omni, {"worker_backend": "process",
                                                "stages": {"token2wav": {"options": {"window": 96}}}}).deploy
    assert deploy.worker_backend == "process"
    assert deploy.stage("token2wav").options == {"window": 96, "first_window": 24, "max_window": 192}
    from transformers import Qwen2_5OmniConfig

    path, cpu = Path(tiny_qwen2_5_omni), torch.device("cpu")
    model = models.load_token2wav(path, Qwen2_5OmniConfig.from_pretrained(path).token2wav_config, cpu)
    first = {window: models.Token2Wav(model, models.load_voices(path), cpu, window=window).first_window
             for window in (96, 8, 0)}
    assert first == {96: 24, 8: 8, 0: 0}
    wide = models.Token2Wav(model, models.load_voices(path), cpu, window=192, max_window=96)
    assert [wide._next_window(done) for done in (0, 24, 216)] == [24, 192, 192]


T2W = "stages.token2wav"


@pytest.mark.parametrize(("stage", "message"), [
    ({"options": {"windw": 48}}, f"{T2W}.options.windw: unknown field; did you mean 'window'?"),
    ({"options": {"window": -48}}, f"{T2W}.options.window: Input should be greater than or equal to 0 (got -48)"),
    ({"options": {"max_window": "96"}}, f"{T2W}.options.max_window: Input should be a valid integer (got '96')"),
    ({"options": {"vocoder_dtype": "float16"}}, f"{T2W}.options.vocoder_dtype: Input should be 'float32' or"),
    ({"options": {"cublas_sm_carveout": 8}}, f"{T2W}.options.cublas_sm_carveout: unknown field"),
    ({"advanced": {"num_steps": 1}}, f"{T2W}.advanced.num_steps: Input should be greater than or equal to 2"),
    ({"advanced": {"tf32": "yes"}}, f"{T2W}.advanced.tf32: Input should be a valid boolean (got 'yes')"),
    ({"advanced": {"cublas_sm_carvout": 8}}, f"{T2W}.advanced.cublas_sm_carvout: unknown field; did you mean "
                                              "'cublas_sm_carveout'?"),
    ({"advanced": {"carveout_max_batch": 0}}, f"{T2W}.advanced.carveout_max_batch: Input should be greater than"),
    ({"advanced": {"overlap_vocoder_max_batch": True}},
     f"{T2W}.advanced.overlap_vocoder_max_batch: Input should be a valid integer (got True)"),
    ({"advanced": {"decode_burst": 8}}, f"{T2W}.advanced.decode_burst: unknown field"),
])
def test_bad_token2wav_settings_fail_at_start_up_naming_the_field(tiny_qwen2_5_omni: str, stage: dict,
                                                                  message: str) -> None:
    from omnistage.errors import ConfigError

    with pytest.raises(ConfigError) as error:
        build_pipeline(tiny_qwen2_5_omni, {"stages": {"token2wav": stage}})
    assert message in str(error.value)


def test_the_talker_takes_ar_tuning_and_no_options(tiny_qwen2_5_omni: str) -> None:
    from omnistage.errors import ConfigError

    build_pipeline(tiny_qwen2_5_omni, {"stages": {"talker": {"advanced": {"decode_burst": 4}}}})
    with pytest.raises(ConfigError, match="stages.talker.advanced.window: unknown field"):
        build_pipeline(tiny_qwen2_5_omni, {"stages": {"talker": {"advanced": {"window": 4}}}})
    with pytest.raises(ConfigError, match="stages.thinker.options: this stage takes no options"):
        build_pipeline(tiny_qwen2_5_omni, {"stages": {"thinker": {"options": {"window": 4}}}})


def test_matmul_sm_carveout_holds_only_inside_its_block() -> None:
    """token2wav's cublas_sm_carveout: torch's process-wide setting, set around the DiT solve's calls and graph
    captures, restored after (also after an error); 0 leaves it alone."""
    assert torch._C._get_sm_carveout_experimental() is None
    with models.matmul_sm_carveout(32):
        assert torch._C._get_sm_carveout_experimental() == 32
    assert torch._C._get_sm_carveout_experimental() is None
    with pytest.raises(ValueError), models.matmul_sm_carveout(16):
        raise ValueError
    assert torch._C._get_sm_carveout_experimental() is None
    with models.matmul_sm_carveout(0):
        assert torch._C._get_sm_carveout_experimental() is None


def test_the_carveout_applies_to_the_solves_of_small_batches_only(tiny_qwen2_5_omni: str) -> None:
    """carveout_max_batch: the solve's graphs (and eager calls) for batches up to it are made under the carveout,
    larger ones at full width; without it every batch is. The batch reaches the setting through BatchGraphs."""
    from transformers import Qwen2_5OmniConfig

    from omnistage.engine.generation.graphs import BatchGraphs

    path, cpu = Path(tiny_qwen2_5_omni), torch.device("cpu")
    model = models.load_token2wav(path, Qwen2_5OmniConfig.from_pretrained(path).token2wav_config, cpu)
    decoder = models.Token2Wav(model, models.load_voices(path), cpu, window=24)
    decoder.cublas_sm_carveout = 32  # what a CUDA device keeps (on the CPU the carveout is forced to 0)
    assert [decoder.carveout_for(b) for b in (1, 2, 4, 32)] == [32, 32, 32, 32]
    decoder.carveout_max_batch = 2
    assert [decoder.carveout_for(b) for b in (1, 2, 4, 32)] == [32, 32, 0, 0]

    seen = []

    def context(batch: int):
        seen.append(batch)
        return models.matmul_sm_carveout(decoder.carveout_for(batch))

    graphs = BatchGraphs(lambda x: x * 2, max_batch=4, context=context)  # nothing captured on the CPU: eager
    assert graphs(torch.ones(3, 5)).tolist() == [[2.0] * 5] * 3
    assert seen == [3]


def test_the_talker_never_samples_a_code_token2wav_cannot_decode(tiny_qwen2_5_omni: str) -> None:
    """Banned for the talker: every codec id past the DiT's code embedding except the two stop codes, and the
    start code; a user's own bad ids are kept. Random weights sampled hot would otherwise reach them (the
    speech demo did: token2wav failed with an index error)."""
    from omnistage.sampling_params import SamplingParams
    from omnistage.types import OmniRequest

    pipeline = build_pipeline(tiny_qwen2_5_omni)
    talker, embeds = pipeline.config.talker_config, pipeline.config.token2wav_config.dit_config.num_embeds
    request = OmniRequest("r", prompt="hi", stage_params={"talker": SamplingParams(bad_token_ids=[5])})
    banned = set(pipeline.talker_params(request).bad_token_ids)
    stops = {talker.tts_codec_end_token_id, talker.tts_codec_pad_token_id}
    assert banned == {5, talker.tts_codec_start_token_id} | set(range(embeds + 1, talker.vocab_size)) - stops
    assert stops <= set(range(embeds + 1, talker.vocab_size))  # the stop codes are past the embedding too


def test_the_vocoder_runs_beside_the_next_solve_unless_the_dit_is_strict_float32() -> None:
    """Beside a strict float32 solve the vocoder starves (a request's first audio comes later); beside a bfloat16
    or TF32 one it finishes early."""
    assert models.default_vocoder_overlap(torch.float32, tf32=False) == 0
    assert models.default_vocoder_overlap(torch.float32, tf32=True) == 2
    assert models.default_vocoder_overlap(torch.bfloat16, tf32=False) == 2


def test_a_requests_handoff_state_is_typed_and_token2wav_takes_its_seed(tiny_qwen2_5_omni: str) -> None:
    """preprocess keeps one OmniHandoff per request; token2wav's noise seed is the seed of the request's token2wav
    sampling params (the third `sampling_params_list` entry), else its `seed` option, else 0."""
    from omnistage.families.qwen2_5_omni import HANDOFF, OmniHandoff, talker_to_token2wav
    from omnistage.sampling_params import SamplingParams
    from omnistage.types import OmniRequest, StageOutput

    pipeline = build_pipeline(tiny_qwen2_5_omni)
    messages = [{"role": "user", "content": "Hello there."}]
    cases = [({"token2wav": SamplingParams(seed=7)}, {"seed": 3}, 7), ({"token2wav": SamplingParams()}, {"seed": 3}, 3),
             ({}, {}, 0)]
    for stage_params, options, seed in cases:
        request = OmniRequest("r", messages=messages, stage_params=stage_params, output_modalities=("text", "audio"),
                              options=options)
        inp = pipeline.preprocess(request)
        state = request.pipeline_state[HANDOFF]
        assert list(request.pipeline_state) == [HANDOFF] and isinstance(state, OmniHandoff)
        assert (state.thinker_input, state.voice, state.talker_open) == (inp, pipeline.voices[0], False)
        out = StageOutput("r", "talker", token_ids=[1, 2], finished=True)
        assert talker_to_token2wav(pipeline, request, out).params == {"voice": pipeline.voices[0], "seed": seed}
