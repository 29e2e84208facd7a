import dataclasses

import pytest

from omnistage.config.deploy import StageConfig, load_deploy_config
from omnistage.engine.ar.engine import ARAdvanced, AREngineConfig
from omnistage.errors import ConfigError
from omnistage.families.registry import detect_family
from omnistage.families.registry import load_pipeline as build_pipeline


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"stages": {"lm": {"max_num_seq": 3}}}, "stages.lm.max_num_seq: unknown field; did you mean 'max_num_seqs'?"),
        ({"worker_backnd": "inline"}, "worker_backnd: unknown field; did you mean 'worker_backend'?"),
        ({"stages": {"*": {"max_num_seqs": "many"}}}, "stages.*.max_num_seqs: Input should be a valid integer"),
        ({"stages": {"lm": {"default_sampling_params": {"temprature": 1}}}}, "did you mean 'temperature'?"),
        ({"stages": {"lm": {"default_sampling_params": {"top_p": 3}}}}, "top_p=3 is invalid"),
        ({"limits": {"max_media_byte": 3}}, "limits.max_media_byte: unknown field; did you mean 'max_media_bytes'?"),
        ({"worker_backend": "threads"}, "worker_backend: Input should be 'inline', 'process' or 'ray'"),
        ({"stages": {"lm": {"decode_burst": 8}}}, "(internal tuning goes under the stage's advanced block"),
        ({"connectors": {"*": {"inline_max_bytes": 0}}}, "connectors.*.inline_max_bytes: unknown field"),
        ({"connectors": {"*": {"advanced": {"inline_max_byte": 0}}}},
         "connectors.*.advanced.inline_max_byte: unknown field; did you mean 'inline_max_bytes'?"),
    ],
)
def test_bad_fields_name_the_field_and_the_closest_valid_one(raw: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_deploy_config(raw)
    assert message in str(err.value)


@pytest.mark.parametrize(
    "stage, message",
    [
        ({"advanced": {"decode_brust": 8}},
         "stages.lm.advanced.decode_brust: unknown field; did you mean 'decode_burst'?"),
        ({"advanced": {"stream_priority": "urgent"}}, "stages.lm.advanced.stream_priority: Input should be 'high' or"),
        ({"advanced": {"decode_burst": 0}}, "stages.lm.advanced.decode_burst: Input should be greater than or equal"),
        ({"advanced": {"overlap_sampled": "yes"}}, "stages.lm.advanced.overlap_sampled: Input should be a valid bool"),
        ({"options": {"window": 8}}, "stages.lm.options.window: unknown field (valid: pooling, normalize)"),
        ({"options": {"pooling": "max"}}, "stages.lm.options.pooling"),
    ],
)
def test_advanced_blocks_are_checked_when_the_pipeline_is_built(tiny_qwen2: str, stage: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_pipeline(tiny_qwen2, {"stages": {"lm": stage}})
    assert message in str(err.value)


def test_yaml_file_defaults_and_dotted_overrides(tmp_path) -> None:
    path = tmp_path / "deploy.yaml"
    path.write_text("stages:\n  '*':\n    max_num_seqs: 4\n  lm:\n    block_size: 8\n")
    config = load_deploy_config(path, {"stages.lm.max_num_seqs": 2, "stages.*.enforce_eager": True})
    lm = config.stage("lm")
    assert (lm.max_num_seqs, lm.block_size, lm.enforce_eager) == (2, 8, True)
    other = config.stage("other")
    assert (other.max_num_seqs, other.block_size, other.enforce_eager) == (4, 16, True)


def test_a_later_layers_star_fields_replace_an_earlier_layers_stage_fields() -> None:
    """Family defaults < the file < --set overrides: a field a layer sets for every stage ("*") wins over what a
    lower layer set for one stage (the shipped configs' token2wav dtype gives way to `stages.*.dtype`)."""
    base = {"stages": {"token2wav": {"dtype": "bfloat16", "max_num_seqs": 32, "advanced": {"tf32": True, "left": 4}}}}
    user = {"stages": {"*": {"dtype": "float32", "advanced": {"tf32": False}}}}
    t2w = load_deploy_config(user, base=base).stage("token2wav")
    assert (t2w.dtype, t2w.max_num_seqs, t2w.advanced) == ("float32", 32, {"tf32": False, "left": 4})
    t2w = load_deploy_config({"stages": {"token2wav": {"dtype": "bfloat16"}}}, {"stages.*.dtype": "float16"}).stage(
        "token2wav")
    assert t2w.dtype == "float16"
    mine = load_deploy_config({"stages": {"*": {"dtype": "float32"}, "token2wav": {"dtype": "bfloat16"}}})
    assert mine.stage("token2wav").dtype == "bfloat16" and mine.stage("lm").dtype == "float32"  # one layer: own wins


def test_connector_and_stage_advanced_settings_reach_their_readers() -> None:
    config = load_deploy_config({"connectors": {"*": {"advanced": {"inline_max_bytes": 0}}},
                                 "stages": {"*": {"advanced": {"stream_priority": "normal"}},
                                            "lm": {"advanced": {"decode_burst": 4}}}})
    assert config.connectors["*"].inline_max_bytes == 0
    lm = config.stage("lm")
    assert lm.stream_priority == "normal" and lm.advanced == {"stream_priority": "normal", "decode_burst": 4}
    assert load_deploy_config({}).stage("lm").stream_priority is None


def test_the_ar_engine_config_comes_from_the_stage_config() -> None:
    """Every sizing and caching field a stage sets reaches the engine; `advanced` goes over the family's `tuned`
    defaults, which go over the engine's own (sampled steps overlapped, one step per launch)."""
    set_fields = {"num_kv_blocks": 7, "kv_cache_memory_gb": 0.5, "gpu_memory_utilization": 0.3, "enforce_eager": True,
                  "block_size": 8, "max_num_seqs": 3, "max_num_batched_tokens": 64, "enable_prefix_caching": False,
                  "enable_chunked_prefill": False}
    stage = StageConfig(**set_fields, default_sampling_params={"temperature": 0.5}, advanced={"decode_burst": 2})
    cfg = AREngineConfig.from_stage(stage, 256, {"embed": 0}, tuned={"decode_burst": 8, "prompt_graph_tokens": 0})
    assert {k: getattr(cfg, k) for k in set_fields} == set_fields
    assert (cfg.max_model_len, cfg.hidden_state_layers, cfg.default_params.temperature) == (256, {"embed": 0}, 0.5)
    assert (cfg.decode_burst, cfg.prompt_graph_tokens, cfg.overlap_sampled, cfg.overlap_decode) == (2, 0, True, True)
    default = AREngineConfig.from_stage(StageConfig(), 128)
    engine_fields = {f.name: f.default for f in dataclasses.fields(AREngineConfig)}
    for name, spec in ARAdvanced.model_fields.items():  # the dataclass's defaults are the advanced block's
        if name in engine_fields:
            assert getattr(default, name) == spec.default == engine_fields[name], name
    with pytest.raises(ConfigError, match="stages.talker.advanced.overlap_sampld: unknown field; did you mean"):
        AREngineConfig.from_stage(StageConfig(advanced={"overlap_sampld": False}), 128, where="stages.talker.advanced")


def test_bad_yaml_and_missing_file(tmp_path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_deploy_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("stages: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_deploy_config(bad)


def test_unknown_stage_name_is_rejected(tiny_qwen2: str) -> None:
    with pytest.raises(ConfigError, match="stages.llm: no such stage; did you mean 'lm'?"):
        build_pipeline(tiny_qwen2, {"stages": {"llm": {"max_num_seqs": 2}}})


def test_family_detection_and_startup_errors(tiny_qwen2: str, tmp_path) -> None:
    family, info = detect_family(tiny_qwen2)
    assert family.name == "causal_lm" and info.architectures == ["Qwen2ForCausalLM"]
    with pytest.raises(ConfigError, match="does not exist"):
        detect_family(tmp_path / "missing")
    with pytest.raises(ConfigError, match="neither config.json nor model_index.json"):
        detect_family(tmp_path)
    (tmp_path / "config.json").write_text('{"architectures": ["MadeUpForMagic"]}')
    with pytest.raises(ConfigError, match=r"\(MadeUpForMagic\) is not a supported model family"):
        detect_family(tmp_path)


def test_the_reference_documents_every_field() -> None:
    """docs/deploy.md names every deploy field and every advanced key."""
    from pathlib import Path

    from omnistage.config.deploy import Advanced, ConnectorAdvanced, ConnectorConfig, DeployConfig, LimitsConfig
    from omnistage.families.qwen2_5_omni import Token2WavAdvanced, Token2WavOptions

    doc = (Path(__file__).parents[2] / "docs" / "deploy.md").read_text()
    models = (DeployConfig, StageConfig, ConnectorConfig, LimitsConfig, Advanced, ARAdvanced, ConnectorAdvanced,
              Token2WavOptions, Token2WavAdvanced)
    missing = [f"{m.__name__}.{name}" for m in models for name in m.model_fields if f"`{name}`" not in doc
               and f"`limits.{name}`" not in doc and name != "type" and name != "options"]
    assert not missing
