import pytest

from omnistage.config.deploy import load_deploy_config
from omnistage.errors import ConfigError
from omnistage.families.registry import detect_family
from omnistage.runtime.launch import build_pipeline


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
        ({"stages": {"lm": {"stream_priority": "urgent"}}}, "stages.lm.stream_priority: Input should be 'high' or"),
    ],
)
def test_bad_fields_name_the_field_and_the_closest_valid_one(raw: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_deploy_config(raw)
    assert message in str(err.value)


def test_yaml_file_defaults_and_dotted_overrides(tmp_path) -> None:
    path = tmp_path / "deploy.yaml"
    path.write_text("stages:\n  '*':\n    max_num_seqs: 4\n  lm:\n    block_size: 8\n")
    config = load_deploy_config(path, {"stages.lm.max_num_seqs": 2, "stages.*.enforce_eager": True})
    lm = config.stage("lm")
    assert (lm.max_num_seqs, lm.block_size, lm.enforce_eager) == (2, 8, True)
    other = config.stage("other")
    assert (other.max_num_seqs, other.block_size, other.enforce_eager) == (4, 16, True)


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
