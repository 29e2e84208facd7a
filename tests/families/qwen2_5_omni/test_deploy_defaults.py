"""Without a deploy config, Qwen2.5-Omni serves the way configs/qwen2_5_omni/1gpu.yaml does (2gpu.yaml's split
where two or more GPUs are visible)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import yaml

from omnistage.families.qwen2_5_omni import models
from omnistage.runtime.launch import build_pipeline

pytest.importorskip("torchvision", reason="Qwen2.5-Omni's processor needs torchvision (installed by scripts/test)")
CONFIGS = Path(__file__).parents[3] / "configs" / "qwen2_5_omni"


def test_defaults_stream_speech_from_stages_sharing_one_device(tiny_qwen2_5_omni: str, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # what this test pins, on any machine
    deploy = build_pipeline(tiny_qwen2_5_omni).deploy
    assert all(deploy.stage(name).devices is None for name in ("thinker", "talker", "token2wav"))
    assert deploy.worker_backend == "inline" and deploy.async_chunk
    # small solves leave SMs to the talker (whether a small batch's vocoder runs beside the next solve follows
    # the DiT's precision: default_vocoder_overlap)
    carveout = {"cublas_sm_carveout": 32, "carveout_max_batch": 2}
    assert deploy.stage("token2wav").options == {"window": 48, "max_window": 192, **carveout}
    assert deploy.stage("token2wav").max_num_seqs == 32
    shares = {name: deploy.stage(name).gpu_memory_utilization for name in ("thinker", "talker")}
    assert shares == {"thinker": 0.55, "talker": 0.25}
    assert deploy.stage("talker").default_sampling_params["top_k"] == 40
    assert deploy.stage("talker").overlap_sampled and not deploy.stage("thinker").overlap_sampled
    assert deploy.stage("talker").decode_burst == 8 and deploy.stage("thinker").decode_burst == 1

    shipped = yaml.safe_load((CONFIGS / "1gpu.yaml").read_text())
    assert shipped["worker_backend"] == deploy.worker_backend and shipped["async_chunk"] == deploy.async_chunk
    assert {k: shipped["stages"]["token2wav"]["options"][k] for k in ("window", "max_window", *carveout)} == {
        "window": 48, "max_window": 192, **carveout}
    assert shipped["stages"]["talker"]["overlap_sampled"] and shipped["stages"]["talker"]["decode_burst"] == 8


@pytest.mark.parametrize("gpus", [2, 4])
def test_two_or_more_gpus_default_to_the_two_gpu_split(tiny_qwen2_5_omni: str, monkeypatch, gpus: int) -> None:
    """With two GPUs or more visible, the defaults are 2gpu.yaml's placement: the talker alone on cuda:1, thinker
    and token2wav on cuda:0, inline, with its memory shares; the rest as on one GPU. A deploy config still wins."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    deploy = build_pipeline(tiny_qwen2_5_omni).deploy
    shipped = yaml.safe_load((CONFIGS / "2gpu.yaml").read_text())
    assert deploy.worker_backend == shipped["worker_backend"] == "inline"
    for name, stage in shipped["stages"].items():
        assert deploy.stage(name).devices == stage["devices"], name
        if "gpu_memory_utilization" in stage:
            assert deploy.stage(name).gpu_memory_utilization == stage["gpu_memory_utilization"], name
    options = deploy.stage("token2wav").options
    assert options == {k: v for k, v in shipped["stages"]["token2wav"]["options"].items() if k in options}
    assert deploy.stage("talker").decode_burst == 8 and deploy.stage("token2wav").max_num_seqs == 32
    one = build_pipeline(tiny_qwen2_5_omni, CONFIGS / "1gpu.yaml").deploy
    assert {one.stage(name).devices for name in ("thinker", "talker", "token2wav")} == {"0"}


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
    try:
        logging.Logger.warning_once.cache_clear()  # transformers says each warning once a process
        build_pipeline(tiny_qwen2_5_omni)
        assert not [m for m in seen.messages if "within the vocabulary" in m]
        logging.Logger.warning_once.cache_clear()
        Qwen2_5OmniConfig.from_pretrained(tiny_qwen2_5_omni)  # the same load outside the pipeline: flagged
        assert any("tts_text_pad_token_id" in m and "within the vocabulary" in m for m in seen.messages)
        seen.messages.clear()
        logging.Logger.warning_once.cache_clear()
        with models.thinker_ids_unflagged():  # any other id out of its vocabulary is still reported
            Qwen2_5OmniConfig.from_pretrained(tiny_qwen2_5_omni, talker_config={"pad_token_id": 10**6})
        flagged = [m for m in seen.messages if "within the vocabulary" in m]
        assert flagged and all(m.startswith("Model config: pad_token_id") for m in flagged)
    finally:
        config_logger.removeHandler(seen)


def test_a_users_options_replace_the_defaults_they_name(tiny_qwen2_5_omni: str) -> None:
    """Setting only `window` keeps the other defaults (`max_window`; below `window` it is no limit) and the
    first chunk at its own default (24 codes, or the window if smaller)."""
    deploy = build_pipeline(tiny_qwen2_5_omni, {"worker_backend": "process",
                                                "stages": {"token2wav": {"options": {"window": 96}}}}).deploy
    assert deploy.worker_backend == "process"
    assert deploy.stage("token2wav").options == {"window": 96, "max_window": 192, "cublas_sm_carveout": 32,
                                                  "carveout_max_batch": 2}
    from transformers import Qwen2_5OmniConfig

    path, cpu = Path(tiny_qwen2_5_omni), torch.device("cpu")
    model = models.load_token2wav(path, Qwen2_5OmniConfig.from_pretrained(path).token2wav_config, cpu)
    first = {window: models.Token2Wav(model, models.load_voices(path), cpu, window=window).first_window
             for window in (96, 8, 0)}
    assert first == {96: 24, 8: 8, 0: 0}
    wide = models.Token2Wav(model, models.load_voices(path), cpu, window=192, max_window=96)
    assert [wide._next_window(done) for done in (0, 24, 216)] == [24, 192, 192]


@pytest.mark.parametrize(("options", "message"), [
    ({"windw": 48}, "stages.token2wav.options.windw: unknown option; did you mean 'window'?"),
    ({"window": -48}, "stages.token2wav.options.window: expected an integer >= 0, got -48"),
    ({"max_window": "96"}, "stages.token2wav.options.max_window: expected an integer >= 1, got '96'"),
    ({"num_steps": 1}, "stages.token2wav.options.num_steps: expected an integer >= 2, got 1"),
    ({"tf32": "yes"}, "stages.token2wav.options.tf32: expected true or false, got 'yes'"),
    ({"cublas_sm_carveout": -8}, "stages.token2wav.options.cublas_sm_carveout: expected an integer >= 0, got -8"),
    ({"carveout_max_batch": 0}, "stages.token2wav.options.carveout_max_batch: expected an integer >= 1, got 0"),
    ({"overlap_vocoder_max_batch": True},
     "stages.token2wav.options.overlap_vocoder_max_batch: expected an integer >= 0, got True"),
    ({"vocoder_dtype": "float16"},
     "stages.token2wav.options.vocoder_dtype: expected one of float32, bfloat16, got 'float16'"),
])
def test_bad_token2wav_options_fail_at_start_up_naming_the_field(tiny_qwen2_5_omni: str, options: dict,
                                                                 message: str) -> None:
    from omnistage.errors import ConfigError

    with pytest.raises(ConfigError) as error:
        build_pipeline(tiny_qwen2_5_omni, {"stages": {"token2wav": {"options": options}}})
    assert message in str(error.value)


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
    """Beside a strict float32 solve the vocoder starves (a request's first audio 0.71 against 0.46 s on an H200,
    run 43e); beside a bfloat16 or TF32 one it finishes early."""
    assert models.default_vocoder_overlap(torch.float32, tf32=False) == 0
    assert models.default_vocoder_overlap(torch.float32, tf32=True) == 2
    assert models.default_vocoder_overlap(torch.bfloat16, tf32=False) == 2
