"""Qwen2.5-Omni through omnistage's three stages against transformers on the tiny checkpoint.

- Thinker: identical greedy tokens to `Qwen2_5OmniForConditionalGeneration.generate`.
- Talker: identical greedy codes to transformers' talker modules run over the inputs that `generate`
  builds for them (thinker states per token, voice bos, codec pad/bos, reply rows, then eos and pad),
  recomputed in full at every step. (`generate` itself in transformers 5.24 calls the talker without
  an attention mask, which skips the codec pad/bos additions and M-RoPE positions its own code
  intends; its codes match ours until the reply runs out and then drift. We follow the intent.)
- token2wav: the same waveform as transformers' token2wav on those codes with the same seed.

Every deploy here pins float32, as the references run: on a GPU, `auto` would pick bfloat16.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from omnistage import Omni, SamplingParams
from omnistage.families.qwen2_5_omni import SPEECH_SYSTEM_PROMPT

pytest.importorskip("torchvision", reason="Qwen2.5-Omni's processor needs torchvision (installed by scripts/test)")

THINKER_TOKENS, TALKER_CODES, VOICE = 8, 24, "Ethan"
FP32 = {"dtype": "float32"}
TWO_GPUS = Path(__file__).parents[3] / "configs" / "qwen2_5_omni" / "2gpu.yaml"
MESSAGES = [{"role": "user", "content": [{"type": "text", "text": "Say something nice about rivers."}]}]


@pytest.fixture(scope="module")
def reference(tiny_qwen2_5_omni: str):
    """Thinker tokens and hidden states from HF generate; talker codes and audio from HF modules."""
    from transformers import Qwen2_5OmniForConditionalGeneration, Qwen2_5OmniProcessor
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(tiny_qwen2_5_omni, dtype=torch.float32).eval()
    processor = Qwen2_5OmniProcessor.from_pretrained(tiny_qwen2_5_omni)
    messages = [{"role": "system", "content": [{"type": "text", "text": SPEECH_SYSTEM_PROMPT}]}, *MESSAGES]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = processor(text=[text], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.thinker.generate(ids, max_new_tokens=THINKER_TOKENS, min_new_tokens=THINKER_TOKENS,
                                     do_sample=False, output_hidden_states=True, return_dict_in_generate=True)
    thinker_tokens = out.sequences[0, ids.shape[1]:].tolist()
    embeds = torch.cat([h[0] for h in out.hidden_states], dim=1)[0]  # per computed token: input embedding
    last = torch.cat([h[-1] for h in out.hidden_states], dim=1)[0]  # and last hidden state
    rows = embeds + last
    talker, n = model.talker, ids.shape[1]
    speaker = model.speaker_map[VOICE]
    text_embed = model.thinker.get_input_embeddings()
    codec_embed = talker.get_input_embeddings()

    def tok(table, i: int) -> torch.Tensor:
        return table(torch.tensor([i]))[0]

    voice_bos = tok(text_embed, int(speaker["bos_token"])) + tok(codec_embed, talker.codec_pad_token)
    prompt = torch.cat([rows[:n], voice_bos[None], (rows[n] + tok(codec_embed, talker.codec_bos_token))[None]])
    reply = [*rows[n + 1:], tok(text_embed, talker.text_eos_token)]
    pad = tok(text_embed, talker.text_pad_token)
    codes: list[int] = []
    history = [talker.codec_mask_token] * n + [talker.codec_pad_token, talker.codec_bos_token]
    penalty = RepetitionPenaltyLogitsProcessor(1.05)
    with torch.no_grad():
        for _ in range(TALKER_CODES):
            inputs = [prompt] + [(tok(codec_embed, c) + (reply[i] if i < len(reply) else pad))[None]
                                 for i, c in enumerate(codes)]
            seq = torch.cat(inputs)
            positions = torch.arange(len(seq))[None, None].expand(3, 1, -1)
            hidden = talker.model(inputs_embeds=talker.thinker_to_talker_proj(seq)[None], position_ids=positions)
            logits = penalty(torch.tensor([history + codes]), talker.codec_head(hidden.last_hidden_state)[:, -1])
            logits[0, talker.codec_bos_token] = float("-inf")
            codes.append(int(logits.argmax()))
        torch.manual_seed(0)
        wav = model.token2wav(torch.tensor([codes]), conditioning=speaker["cond"].float(),
                              reference_mel=speaker["ref_mel"].float()).reshape(-1)
    return thinker_tokens, wav


@pytest.mark.parametrize("async_chunk, burst", [(False, 1), (True, 1), (True, 8)],
                         ids=["handoff-at-end", "streamed-handoff", "streamed-handoff-bursts"])
def test_text_and_speech_equal_transformers(tiny_qwen2_5_omni: str, reference, async_chunk: bool, burst: int) -> None:
    """Streamed, the talker starts while the thinker still writes and waits for each reply row; with decode
    bursts (the default) it draws several codes per launch once the reply is over."""
    thinker_tokens, wav = reference
    params = {
        "thinker": SamplingParams(max_tokens=THINKER_TOKENS, temperature=0, ignore_eos=True),
        "talker": SamplingParams(max_tokens=TALKER_CODES, temperature=0, repetition_penalty=1.05, ignore_eos=True),
    }
    deploy = {"async_chunk": async_chunk,
              "stages": {"*": {"max_model_len": 512, **FP32}, "talker": {"advanced": {
                  "overlap_sampled": True, "decode_burst": burst}}}}
    with Omni(tiny_qwen2_5_omni, deploy) as omni:
        (spoken,) = omni.generate([MESSAGES], params, ("text", "audio"), voice=VOICE)
        (text_only,) = omni.generate([MESSAGES], params["thinker"])
        stats = omni.stats()
    assert spoken.error is None, spoken.error
    assert spoken.token_ids == thinker_tokens
    assert spoken.sample_rate == 24000 and spoken.audio.shape == wav.shape
    assert isinstance(spoken.audio, np.ndarray) and spoken.audio.dtype == np.float32
    torch.testing.assert_close(torch.from_numpy(spoken.audio), wav.float(), rtol=1e-4, atol=1e-4)
    assert text_only.audio is None and text_only.error is None
    assert stats["talker"]["kv_blocks_used"] == 0 and stats["talker"]["num_running"] == 0
    # the talker's (penalised) decode steps ran in flight: penalties from the device-side history, thinker rows
    # added on the device
    if burst == 1:
        assert stats["talker"]["num_overlapped_steps"] > TALKER_CODES // 2
    else:
        assert stats["talker"]["num_burst_steps"] >= TALKER_CODES // 2
    assert stats["thinker"]["num_overlapped_steps"] > 0  # its hidden states leave steps kept in flight too


def test_talker_through_the_triton_kernels_equals_transformers(tiny_qwen2_5_omni: str, reference,
                                                               monkeypatch) -> None:
    """The skinny-GEMM path forced on (on CPU: Triton's interpreter), as decode steps take it on a GPU: the talker's
    input projection (thinker width -> talker width, with a bias) leaves split-K partials, the bias on the first,
    that the first layer's add+RMSNorm sums; text and speech still equal transformers'."""
    import omnistage.kernels.fused as fused
    import omnistage.kernels.skinny_gemm as skinny

    pytest.importorskip("triton")
    launch, launches = skinny._launch, []

    def spy(x, weight, bias, *args, **kwargs):
        y = launch(x, weight, bias, *args, **kwargs)
        launches.append((tuple(weight.shape), bias is not None, y.dim() == 3))
        return y

    monkeypatch.setattr(skinny, "_use_triton", lambda x: x.dim() == 2 and x.shape[0] <= skinny.MAX_ROWS)
    monkeypatch.setattr(skinny, "choose_tiling", lambda *shape, **kw: skinny.Tiling(block_n=16, block_k=16, splits=2))
    monkeypatch.setattr(skinny, "_launch", spy)
    monkeypatch.setattr(fused, "_use_triton", lambda x: True)
    thinker_tokens, wav = reference
    params = {
        "thinker": SamplingParams(max_tokens=THINKER_TOKENS, temperature=0, ignore_eos=True),
        "talker": SamplingParams(max_tokens=TALKER_CODES, temperature=0, repetition_penalty=1.05, ignore_eos=True),
    }
    # inline, so the patches reach the stages; the reply handed over at its end, so no two stages run the
    # interpreter at once (its state is not thread-safe)
    deploy = {"async_chunk": False, "worker_backend": "inline", "stages": {"*": {"max_model_len": 512, **FP32}}}
    with Omni(tiny_qwen2_5_omni, deploy) as omni:
        (spoken,) = omni.generate([MESSAGES], params, ("text", "audio"), voice=VOICE)
    assert spoken.error is None, spoken.error
    assert spoken.token_ids == thinker_tokens
    torch.testing.assert_close(torch.from_numpy(spoken.audio), wav.float(), rtol=1e-4, atol=1e-4)
    from transformers import AutoConfig

    talker = AutoConfig.from_pretrained(tiny_qwen2_5_omni).talker_config
    projection = (talker.hidden_size, talker.embedding_size)
    assert (projection, True, True) in launches, "the input projection should leave partials with its bias"


def test_image_and_audio_input_equal_transformers(tiny_qwen2_5_omni: str) -> None:
    import numpy as np
    from PIL import Image
    from transformers import Qwen2_5OmniForConditionalGeneration, Qwen2_5OmniProcessor

    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 255, (56, 84, 3), dtype=np.uint8))
    audio = (0.3 * np.sin(2 * np.pi * 440 * np.arange(16000) / 16000)).astype(np.float32)
    question = {"type": "text", "text": "What do you see and hear?"}
    placeholders = [{"role": "user", "content": [{"type": "image"}, {"type": "audio"}, question]}]
    processor = Qwen2_5OmniProcessor.from_pretrained(tiny_qwen2_5_omni)
    text = processor.apply_chat_template(placeholders, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=[image], audio=[audio], return_tensors="pt")
    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(tiny_qwen2_5_omni, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.thinker.generate(**inputs, max_new_tokens=THINKER_TOKENS, min_new_tokens=THINKER_TOKENS,
                                     do_sample=False)
    expected = out[0, inputs["input_ids"].shape[1]:].tolist()
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "audio", "audio": audio},
                                             question]}]
    with Omni(tiny_qwen2_5_omni, {"stages": {"*": {"max_model_len": 512, **FP32}}}) as omni:
        (got,) = omni.generate([messages], SamplingParams(max_tokens=THINKER_TOKENS, temperature=0, ignore_eos=True))
    assert got.error is None, got.error
    assert got.num_prompt_tokens == inputs["input_ids"].shape[1]
    assert got.token_ids == expected


def test_parallel_requests_keep_their_own_audio(tiny_qwen2_5_omni: str) -> None:
    """Requests with different voices and lengths, run together, each equal their solo run."""
    cases = [("Ethan", 6, 12), ("Chelsie", 9, 20), ("Ethan", 4, 16), ("Chelsie", 7, 10),
             ("Chelsie", 5, 12), ("Ethan", 8, 20), ("Chelsie", 3, 16), ("Ethan", 10, 8)]

    def params(thinker_len: int, codes: int) -> dict:
        return {"thinker": SamplingParams(max_tokens=thinker_len, temperature=0, ignore_eos=True),
                "talker": SamplingParams(max_tokens=codes, temperature=0, repetition_penalty=1.05, ignore_eos=True)}

    prompts = [[{"role": "user", "content": f"Tell me about the number {i}."}] for i in range(len(cases))]
    with Omni(tiny_qwen2_5_omni, {"stages": {"*": {"max_model_len": 512, **FP32}}}) as omni:
        solo = [omni.generate([p], params(t, c), ("text", "audio"), voice=v)[0]
                for p, (v, t, c) in zip(prompts, cases, strict=True)]
        together = [None] * len(cases)

        def run(i: int) -> None:
            v, t, c = cases[i]
            together[i] = omni.generate([prompts[i]], params(t, c), ("text", "audio"), voice=v)[0]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(cases))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    for (_, t, c), a, b in zip(cases, solo, together, strict=True):
        assert a.error is None and b.error is None
        assert a.token_ids == b.token_ids and len(a.token_ids) == t
        assert a.audio.shape == b.audio.shape == (c * 2 * 240,)
        np.testing.assert_allclose(a.audio, b.audio, rtol=1e-4, atol=1e-5)
    assert not np.array_equal(solo[0].audio[:1000], solo[1].audio[:1000])


def test_windowed_token2wav_streams_audio_close_to_one_shot(tiny_qwen2_5_omni: str) -> None:
    """With `async_chunk` and token2wav windows, audio arrives in several chunks while codes still come;
    joined, they stay within 3% (RMS) of the one-shot decode (measured: 1.4% with these small windows)."""
    import asyncio

    from omnistage import AsyncOmni
    from omnistage.types import OmniRequest

    messages = [{"role": "user", "content": "Tell me a long story."}]
    params = {"thinker": SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
              "talker": SamplingParams(max_tokens=48, temperature=0, repetition_penalty=1.05, ignore_eos=True)}
    with Omni(tiny_qwen2_5_omni, {"stages": {"*": {"max_model_len": 512, **FP32}}}) as omni:
        (whole,) = omni.generate([messages], params, ("text", "audio"), voice=VOICE)
    windows = {"options": {"window": 8}, "advanced": {"left": 8, "right": 4, "vocoder_context": 8}}
    engine = AsyncOmni(tiny_qwen2_5_omni, {"async_chunk": True, "stages": {
        "*": {"max_model_len": 512, **FP32}, "token2wav": windows}})

    async def stream() -> list[torch.Tensor]:
        request = OmniRequest(request_id="s", messages=messages, stage_params=params,
                              output_modalities=("text", "audio"), options={"voice": VOICE})
        return [o.audio async for o in engine.generate(request) if o.audio is not None and o.audio.size]

    try:
        chunks = asyncio.run(stream())
    finally:
        engine.shutdown()
    streamed = np.concatenate(chunks)
    assert len(chunks) >= 2 and streamed.shape == whole.audio.shape
    relative_rms = np.sqrt(np.mean((streamed - whole.audio) ** 2) / np.mean(whole.audio**2))
    assert relative_rms < 0.03, relative_rms


def test_abort_reaches_all_three_stages(tiny_qwen2_5_omni: str) -> None:
    """A caller who leaves mid-speech frees the thinker's and talker's KV blocks and token2wav's state."""
    import asyncio
    import contextlib
    import time

    from omnistage import AsyncOmni
    from omnistage.types import OmniRequest

    long = {"thinker": SamplingParams(max_tokens=400, temperature=0, ignore_eos=True),
            "talker": SamplingParams(max_tokens=600, temperature=0, ignore_eos=True)}
    engine = AsyncOmni(tiny_qwen2_5_omni, {"async_chunk": True, "stages": {
        "*": {"max_model_len": 1024, **FP32}, "token2wav": {"options": {"window": 8},
                                                           "advanced": {"left": 8, "right": 4}}}})

    async def leave_early() -> None:
        request = OmniRequest(request_id="gone", messages=MESSAGES, stage_params=long,
                              output_modalities=("text", "audio"), options={"voice": VOICE})
        seen = []

        async def consume() -> None:  # the server's consumer of the stream
            async for out in engine.generate(request):
                seen.append(out.error or len(out.token_ids))

        task = asyncio.ensure_future(consume())
        for _ in range(1000):  # until both AR stages hold KV blocks
            await asyncio.sleep(0.005)
            stats = engine.stats()
            if (stats["talker"]["kv_blocks_used"] and stats["thinker"]["kv_blocks_used"]) or task.done():
                break
        # a request that ended first says how here (its last outputs or errors, the stages' counters)
        assert not task.done() and stats["talker"]["kv_blocks_used"] > 0, (task, seen[-5:], stats)
        task.cancel()  # what a client disconnect does to the server's consumer
        with contextlib.suppress(asyncio.CancelledError):
            await task

    try:
        asyncio.run(leave_early())
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            stats = engine.stats()
            if all(s.get("kv_blocks_used", 0) == 0 and s["num_running"] == 0 and s["num_waiting"] == 0
                   for s in stats.values()):
                break
            time.sleep(0.05)
        assert all(s.get("kv_blocks_used", 0) == 0 and s["num_running"] == 0 and s["num_waiting"] == 0
                   for s in stats.values()), stats
    finally:
        engine.shutdown()


@pytest.mark.parametrize("backend", ["process", "ray"])
def test_stages_out_of_process_give_the_same_speech(tiny_qwen2_5_omni: str, backend: str) -> None:
    """The three stages as worker processes (payloads over shared memory) or as Ray actors on a local cluster
    (over TCP; on a GPU machine the three share one reserved GPU, as 1gpu.yaml's do), streamed between stages,
    produce what the inline stages produce."""
    ray = pytest.importorskip("ray", reason="Ray is an optional extra") if backend == "ray" else None
    params = {"thinker": SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
              "talker": SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)}
    outs = []
    if ray is not None:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        for worker_backend, async_chunk in (("inline", False), (backend, True)):
            deploy = {"worker_backend": worker_backend, "async_chunk": async_chunk,
                      "stages": {"*": {"max_model_len": 512, **FP32}}}
            with Omni(tiny_qwen2_5_omni, deploy) as omni:
                outs.append(omni.generate([MESSAGES], params, ("text", "audio"), voice="Chelsie")[0])
    finally:
        if ray is not None:
            ray.shutdown()
    inline, apart = outs
    assert apart.error is None and apart.token_ids == inline.token_ids
    np.testing.assert_allclose(apart.audio, inline.audio, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("backend", ["inline", "process"])
def test_stages_on_two_gpus_give_the_same_speech(tiny_qwen2_5_omni: str, backend: str) -> None:
    """configs/qwen2_5_omni/2gpu.yaml's split (the talker on cuda:1, thinker and token2wav on cuda:0) produces what
    all three on cuda:0 produce. Inline, hidden states cross from cuda:0 to cuda:1 and codes back, and each
    stage's start-up (Triton kernels, graph captures) runs with its own device current."""
    shipped = yaml.safe_load(TWO_GPUS.read_text())["stages"]
    devices = {name: {"devices": stage["devices"]} for name, stage in shipped.items()}
    assert {d["devices"] for d in devices.values()} == {"0", "1"}  # the config does use both
    params = {"thinker": SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
              "talker": SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)}
    outs = []
    for split in (False, True):
        stages = {"*": {"max_model_len": 512, **FP32}} | (devices if split else {})
        deploy = {"worker_backend": backend if split else "inline", "async_chunk": True, "stages": stages}
        with Omni(tiny_qwen2_5_omni, deploy) as omni:
            outs.append(omni.generate([MESSAGES], params, ("text", "audio"), voice="Chelsie")[0])
    one, two = outs
    assert one.error is None and two.error is None
    assert two.token_ids == one.token_ids and two.audio.shape == one.audio.shape == (40 * 2 * 240,)
    np.testing.assert_allclose(two.audio, one.audio, rtol=1e-4, atol=1e-5)


def test_token2wav_batches_same_length_requests(tiny_qwen2_5_omni: str) -> None:
    """Requests whose codes have the same length share one flow-matching run; each gets what it would
    alone (different voices and seeds included)."""
    from pathlib import Path

    from transformers import Qwen2_5OmniConfig

    from omnistage.families.qwen2_5_omni import models
    from omnistage.types import StageInput

    path = Path(tiny_qwen2_5_omni)
    config = Qwen2_5OmniConfig.from_pretrained(path).token2wav_config
    decoder = models.Token2Wav(models.load_token2wav(path, config, torch.device("cpu")), models.load_voices(path),
                               torch.device("cpu"))

    def request(name: str, voice: str, seed: int, codes: list[int]) -> StageInput:
        return StageInput(name, codes, params={"voice": voice, "seed": seed})

    rng = torch.Generator().manual_seed(1)
    specs = [("a", "Ethan", 0, torch.randint(0, 256, (14,), generator=rng).tolist()),
             ("b", "Chelsie", 5, torch.randint(0, 256, (14,), generator=rng).tolist()),
             ("c", "Ethan", 2, torch.randint(0, 256, (9,), generator=rng).tolist())]
    alone = [decoder.generate([request(*s)])[0][0]["audio"] for s in specs]
    together = [out["audio"] for out, _ in decoder.generate([request(*s) for s in specs])]
    for a, b in zip(alone, together, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(alone[0], alone[1])


def test_video_with_its_audio_track_equals_transformers(tiny_qwen2_5_omni: str) -> None:
    """A video part (data URL) with `use_audio_in_video`: frames and sound interleaved in M-RoPE time."""
    import base64

    from transformers import Qwen2_5OmniForConditionalGeneration, Qwen2_5OmniProcessor

    from omnistage.media import load_part

    pytest.importorskip("av")  # PyAV (the omni extra) makes and decodes the video
    from omnistage.testing.media_files import make_video

    part = {"type": "video_url", "video_url": {
        "url": "data:video/mp4;base64," + base64.b64encode(make_video(frames=20, fps=10, size=(56, 56))).decode()}}
    question = {"type": "text", "text": "What happens?"}
    video = load_part(part, use_audio_in_video=True).value  # what omnistage decodes, fed to both sides
    processor = Qwen2_5OmniProcessor.from_pretrained(tiny_qwen2_5_omni)
    template = [{"role": "user", "content": [{"type": "video"}, question]}]
    text = processor.apply_chat_template(template, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], videos=[video.frames], audio=[video.audio], fps=video.fps,
                       load_audio_from_video=True, audio_from_video_indices=[0], return_tensors="pt")
    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(tiny_qwen2_5_omni, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.thinker.generate(**inputs, use_audio_in_video=True, max_new_tokens=THINKER_TOKENS,
                                     min_new_tokens=THINKER_TOKENS, do_sample=False)
    expected = out[0, inputs["input_ids"].shape[1]:].tolist()
    with Omni(tiny_qwen2_5_omni, {"stages": {"*": {"max_model_len": 1024, **FP32}}}) as omni:
        (got,) = omni.generate([[{"role": "user", "content": [part, question]}]],
                               SamplingParams(max_tokens=THINKER_TOKENS, temperature=0, ignore_eos=True),
                               use_audio_in_video=True)
    assert got.error is None, got.error
    assert got.num_prompt_tokens == inputs["input_ids"].shape[1]
    assert got.token_ids == expected


def test_thinker_and_talker_run_the_fused_layers(tiny_qwen2_5_omni: str) -> None:
    """The parity tests above go through the fused forward (M-RoPE included): make sure it is in use."""
    from transformers import Qwen2_5OmniForConditionalGeneration

    from omnistage.families.qwen2_5_omni.models import fused_forward

    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(tiny_qwen2_5_omni, dtype=torch.float32)
    assert fused_forward(model.thinker.model.language_model) is not None
    assert fused_forward(model.talker.model) is not None


@pytest.mark.parametrize("kept_context", [True, False], ids=["kept-context", "left-context-solved-again"])
def test_token2wav_default_windows_follow_the_dit_blocks(tiny_qwen2_5_omni: str, kept_context: bool) -> None:
    """With the context left to its defaults (the DiT's attention reach: the previous window's kept keys and
    values, or the look-back blocks solved again), a 12-code first chunk then 24-code chunks come out whatever
    the codes' arrival pattern, and joined they stay within 1% RMS of the one-shot decode (measured: 0.54%
    with the kept context, 0.66% solving the left context again)."""
    from pathlib import Path

    from transformers import Qwen2_5OmniConfig

    from omnistage.families.qwen2_5_omni import models
    from omnistage.types import StageInput

    path, cpu = Path(tiny_qwen2_5_omni), torch.device("cpu")
    config = Qwen2_5OmniConfig.from_pretrained(path).token2wav_config
    model, voices = models.load_token2wav(path, config, cpu), models.load_voices(path)
    codes = torch.randint(0, config.dit_config.num_embeds - 1, (60,), generator=torch.Generator().manual_seed(0))

    def stream(decoder: models.Token2Wav, arrivals: int) -> list[np.ndarray]:
        """Codes arrive `arrivals` at a time; each ready step decodes what the decoder plans."""
        inp, chunks = StageInput("r", [], params={"voice": VOICE, "seed": 0}, final=False), []
        for n in range(arrivals, len(codes) + arrivals, arrivals):
            inp.token_ids, inp.final = codes[:n].tolist(), n >= len(codes)
            while decoder.ready(inp):
                ((tensors, finished),) = decoder.generate([inp])
                chunks.append(tensors["audio"].numpy())
                if finished:
                    return chunks
        return chunks

    whole = np.concatenate(stream(models.Token2Wav(model, voices, cpu), len(codes)))
    windowed = models.Token2Wav(model, voices, cpu, window=24, first_window=12, kept_context=kept_context)
    # tiny DiT: 12-code blocks, one look-back/ahead layer
    assert (windowed.kept_context, windowed.left, windowed.right) == (kept_context, 0 if kept_context else 12, 12)
    one_by_one, all_at_once = stream(windowed, 1), stream(windowed, len(codes))
    samples_per_code = 2 * models.Token2Wav.HOP
    assert [len(c) // samples_per_code for c in one_by_one] == [12, 24, 24]
    assert [len(c) for c in all_at_once] == [len(c) for c in one_by_one]  # timing does not move windows
    np.testing.assert_array_equal(np.concatenate(all_at_once), np.concatenate(one_by_one))
    streamed = np.concatenate(one_by_one)
    assert streamed.shape == whole.shape
    assert np.sqrt(np.mean((streamed - whole) ** 2) / np.mean(whole**2)) < 0.01
    # Growing windows (12, then 12 doubling up to 24): the same bound, one chunk more.
    growing = models.Token2Wav(model, voices, cpu, window=12, first_window=12, max_window=24,
                               kept_context=kept_context)
    chunks = stream(growing, 1)
    assert [len(c) // samples_per_code for c in chunks] == [12, 12, 24, 12]
    assert [len(c) for c in stream(growing, len(codes))] == [len(c) for c in chunks]
    grown = np.concatenate(chunks)
    assert grown.shape == whole.shape
    assert np.sqrt(np.mean((grown - whole) ** 2) / np.mean(whole**2)) < 0.01


def test_token2wav_dtype_sets_the_dit_precision_only(tiny_qwen2_5_omni: str) -> None:
    """`stages.token2wav.dtype: bfloat16` puts the DiT in bfloat16; the vocoder and the audio stay float32,
    near the float32 decode (measured 5.0% RMS on these random weights; 0.6% on the released layout)."""
    from omnistage.families.registry import load_pipeline as build_pipeline

    messages = [{"role": "user", "content": "Tell me a story."}]
    params = {"thinker": SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
              "talker": SamplingParams(max_tokens=24, temperature=0, repetition_penalty=1.05, ignore_eos=True)}
    audio = {}
    for dtype in ("float32", "bfloat16"):
        deploy = {"stages": {"*": {"max_model_len": 512, **FP32}, "token2wav": {"dtype": dtype}}}
        decoder = build_pipeline(tiny_qwen2_5_omni, deploy).build_engine("token2wav").model
        vocoder = decoder.model.code2wav_bigvgan_model
        assert decoder.dit_dtype == getattr(torch, dtype)
        assert next(vocoder.parameters()).dtype == torch.float32
        with Omni(tiny_qwen2_5_omni, deploy) as omni:
            (out,) = omni.generate([messages], params, ("text", "audio"), voice=VOICE)
        audio[dtype] = out.audio
    assert audio["bfloat16"].dtype == np.float32 and audio["bfloat16"].shape == audio["float32"].shape
    rms = np.sqrt(np.mean((audio["bfloat16"] - audio["float32"]) ** 2) / np.mean(audio["float32"] ** 2))
    assert 0 < rms < 0.15, rms


def test_token2wav_graph_shapes_cover_streaming_windows(tiny_qwen2_5_omni: str) -> None:
    """The solve shapes captured at start-up (tests/.../test_cuda_graphs.py captures them on a GPU) are
    exactly those a streamed request's first and middle windows use; only its last, shorter window runs
    eagerly. Recorded here from the solves a streamed request really makes."""
    from pathlib import Path

    from transformers import Qwen2_5OmniConfig

    from omnistage.families.qwen2_5_omni import models
    from omnistage.types import StageInput

    path, cpu = Path(tiny_qwen2_5_omni), torch.device("cpu")
    config = Qwen2_5OmniConfig.from_pretrained(path).token2wav_config
    decoder = models.Token2Wav(models.load_token2wav(path, config, cpu), models.load_voices(path), cpu,
                               window=24, first_window=12)
    solved: list[int] = []  # codes per solve, mel frames per vocoder pass
    vocoded: list[int] = []
    solve, vocode = decoder.solve.fn, decoder.vocode.fn
    decoder.solve.fn = lambda *inputs: solved.append(inputs[1].shape[1]) or solve(*inputs)
    decoder.vocode.fn = lambda mel: vocoded.append(mel.shape[-1]) or vocode(mel)
    inp = StageInput("r", [], params={"voice": VOICE, "seed": 0}, final=False)
    for n in range(1, 85):  # 12 + 24 + 24 + 24 codes: first, two middle windows, a last one
        inp.token_ids, inp.final = [n % 32] * n, n == 84
        while decoder.ready(inp):
            ((_, finished),) = decoder.generate([inp])
            if finished or not inp.final:
                break
    assert inp.params["emitted"] == 84
    assert (decoder.kept_context, decoder.right) == (True, 12)  # the tiny DiT's attention reach
    # first: 12 codes + 12 look-ahead, vocoded with 16 frames after; middle: 24 + 12 (the left context kept from
    # the window before), 16 frames each side (those on the left kept too)
    assert decoder.window_shapes() == {(12 + 12, 24 + 16), (24 + 12, 16 + 48 + 16)}
    captured = decoder.window_shapes()
    assert [shape in captured for shape in zip(solved, vocoded, strict=True)] == [True, True, True, False]
    assert solved[-1] == 24  # the last window (60..84): no look-ahead left
    assert decoder.solve.batches == [1, 2, 4, 8, 16]  # max_batch 16: a batch of 13 replays 8 + 4 + 1


@pytest.mark.parametrize("left", [12, 6], ids=["whole-blocks", "half-block"])
def test_token2wav_graph_shapes_cover_growing_windows(tiny_qwen2_5_omni: str, left: int) -> None:
    """With windows growing (12, then 12 doubling to 48) the captured shapes are exactly those of every
    window a long streamed request solves but its last, also when the left context is not whole blocks
    (window starts then cycle)."""
    from pathlib import Path

    from transformers import Qwen2_5OmniConfig

    from omnistage.families.qwen2_5_omni import models
    from omnistage.types import StageInput

    path, cpu = Path(tiny_qwen2_5_omni), torch.device("cpu")
    config = Qwen2_5OmniConfig.from_pretrained(path).token2wav_config
    decoder = models.Token2Wav(models.load_token2wav(path, config, cpu), models.load_voices(path), cpu,
                               window=12, first_window=12, max_window=48, left=left, num_steps=2)
    shapes: list[tuple[int, int]] = []
    solve, vocode = decoder.solve.fn, decoder.vocode.fn
    decoder.solve.fn = lambda *inputs: shapes.append((inputs[1].shape[1], 0)) or solve(*inputs)
    decoder.vocode.fn = lambda mel: shapes.__setitem__(-1, (shapes[-1][0], mel.shape[-1])) or vocode(mel)
    total = 12 + 12 + 24 + 48 * 6 + 20  # the last window longer than the look-ahead: only it is cut short
    inp = StageInput("r", [0] * total, params={"voice": VOICE, "seed": 0}, final=True)
    sizes = []
    while True:
        before = inp.params.get("emitted", 0)
        ((_, finished),) = decoder.generate([inp])
        sizes.append(inp.params["emitted"] - before)
        if finished:
            break
    assert sizes == [12, 12, 24, *[48] * 6, 20]
    assert set(shapes[:-1]) == decoder.window_shapes()
    assert shapes[-1] not in decoder.window_shapes()


@pytest.mark.parametrize("device", ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_dit_solver_equals_transformers_sample(tiny_qwen2_5_omni: str, dtype: torch.dtype, device: str) -> None:
    """Our solve (speaker encoder once per voice, time conditioning once, fused projections; on a GPU the
    Triton block attention and norm kernels) against transformers' `Qwen2_5OmniToken2WavDiTModel.sample`
    from the same noise, batch of two voices."""
    from pathlib import Path

    from transformers import Qwen2_5OmniConfig

    from omnistage.families.qwen2_5_omni import models
    from omnistage.families.qwen2_5_omni.dit import DiTSolver

    path, dev = Path(tiny_qwen2_5_omni), torch.device(device)
    config = Qwen2_5OmniConfig.from_pretrained(path).token2wav_config
    dit = models.load_token2wav(path, config, dev, dtype).code2wav_dit_model
    voices = models.load_voices(path)
    cond = torch.cat([voices[v]["cond"] for v in ("Ethan", "Chelsie")]).to(dev, dtype)
    ref_mel = torch.cat([voices[v]["ref_mel"] for v in ("Ethan", "Chelsie")]).to(dev, dtype)
    codes = torch.randint(0, config.dit_config.num_embeds - 1, (2, 30), generator=torch.Generator().manual_seed(3))
    codes = codes.to(dev)
    with torch.inference_mode():
        torch.manual_seed(7)
        expected = dit.sample(cond, ref_mel, codes)  # draws its noise first thing
        torch.manual_seed(7)
        noise = torch.randn([2, 30 * dit.repeats, dit.mel_dim], dtype=dtype, device=dev)  # as sample draws it
        solver = DiTSolver(dit, num_steps=10, guidance_scale=0.5, sway=-1.0)
        features = torch.cat([solver.speaker_features(ref_mel[i : i + 1]) for i in range(2)])
        got = solver.solve(noise, codes, cond, features)
    assert got.shape == expected.shape == (2, dit.mel_dim, 60)
    rel = ((got.float() - expected.float()).norm() / expected.float().norm()).item()
    assert rel < (1e-5 if dtype == torch.float32 else 2e-2), rel


@pytest.mark.parametrize("device", ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
def test_a_padded_solve_equals_solving_each_window_alone(tiny_qwen2_5_omni: str, device: str) -> None:
    """Windows of 30 and 17 codes solved in one batch padded to 48 codes (as a shorter window joins a captured
    graph's shape): each one's mel frames equal its own unpadded solve."""
    from pathlib import Path

    from transformers import Qwen2_5OmniConfig

    from omnistage.families.qwen2_5_omni import models
    from omnistage.families.qwen2_5_omni.dit import DiTSolver

    path, dev = Path(tiny_qwen2_5_omni), torch.device(device)
    config = Qwen2_5OmniConfig.from_pretrained(path).token2wav_config
    dit = models.load_token2wav(path, config, dev).code2wav_dit_model
    voices = models.load_voices(path)
    solver = DiTSolver(dit, num_steps=4, guidance_scale=0.5, sway=-1.0)
    generator = torch.Generator().manual_seed(5)
    lengths, padded, r = [30, 17], 48, dit.repeats
    codes = torch.randint(0, config.dit_config.num_embeds - 1, (2, padded), generator=generator).to(dev)
    noise = torch.randn(2, padded * r, dit.mel_dim, generator=generator).to(dev)
    with torch.inference_mode():
        features = {v: solver.speaker_features(voices[v]["ref_mel"].to(dev)) for v in ("Ethan", "Chelsie")}
        cond = {v: voices[v]["cond"].to(dev) for v in features}
        together = solver.solve(noise, codes, torch.cat([cond["Ethan"], cond["Chelsie"]]),
                                torch.cat([features["Ethan"], features["Chelsie"]]),
                                torch.tensor([n * r for n in lengths], device=dev))
        for row, (voice, n) in enumerate(zip(("Ethan", "Chelsie"), lengths, strict=True)):
            alone = solver.solve(noise[row : row + 1, : n * r], codes[row : row + 1, :n], cond[voice],
                                 features[voice])
            torch.testing.assert_close(together[row : row + 1, :, : n * r], alone, rtol=1e-4, atol=1e-5)


def test_short_windows_join_a_captured_length_without_changing_the_audio(tiny_qwen2_5_omni: str) -> None:
    """With graphs (here: their lengths set by hand, the solves eager on the CPU) a window shorter than a
    captured length is solved padded to it, with others of that length: two requests whose last windows differ
    in length share one solve, and the audio equals the decoder that solves every length on its own. Between
    windows each request holds only its own kept context (not the whole batch's), and none once it is done."""
    from pathlib import Path

    from transformers import Qwen2_5OmniConfig

    from omnistage.families.qwen2_5_omni import models
    from omnistage.types import StageInput

    path, cpu = Path(tiny_qwen2_5_omni), torch.device("cpu")
    config = Qwen2_5OmniConfig.from_pretrained(path).token2wav_config
    model, voices = models.load_token2wav(path, config, cpu), models.load_voices(path)
    generator = torch.Generator().manual_seed(1)
    codes = [torch.randint(0, config.dit_config.num_embeds - 1, (n,), generator=generator).tolist() for n in (41, 45)]

    def decode(decoder: models.Token2Wav) -> tuple[list[np.ndarray], list[int]]:
        solved: list[int] = []
        solve = decoder.solve.fn
        decoder.solve.fn = lambda *inputs: solved.append(inputs[1].shape[0]) or solve(*inputs)
        inputs = [StageInput(f"r{i}", c, params={"voice": v, "seed": i}, final=True)
                  for i, (c, v) in enumerate(zip(codes, ("Ethan", "Chelsie"), strict=True))]
        audio: list[list[np.ndarray]] = [[], []]
        pending = set(range(len(inputs)))
        while pending:
            for i, (tensors, finished) in zip(sorted(pending), decoder.generate([inputs[i] for i in sorted(pending)]),
                                              strict=True):
                audio[i].append(tensors["audio"].numpy())
                if finished:
                    pending.discard(i)
            for i, inp in enumerate(inputs):  # a waiting request holds its own kept context, a finished one none
                kept = inp.params.get("kept")
                assert (kept is None) == (i not in pending)
                assert kept is None or kept.untyped_storage().nbytes() == kept.numel() * kept.element_size()
        return [np.concatenate(a) for a in audio], solved

    def decoder() -> models.Token2Wav:
        return models.Token2Wav(model, voices, cpu, window=12, first_window=12, max_window=24, num_steps=3)

    alone, solves_alone = decode(decoder())
    padded = decoder()
    padded.solve_lengths = sorted({codes for codes, _ in padded.window_shapes()})
    together, solves_together = decode(padded)
    assert (solves_alone, solves_together) == ([2, 2, 1, 1], [2, 2, 2])  # last windows: 29 and 33 codes, both at 36
    for got, expected in zip(together, alone, strict=True):
        assert got.shape == expected.shape
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_a_last_window_of_a_new_length_is_vocoded_at_a_captured_one(tiny_qwen2_5_omni: str) -> None:
    """With vocoder graphs (their lengths set by hand, the passes eager on the CPU) a last window whose mel span
    has no graph takes more of the request's earlier mel on its left, up to a captured length, instead of an
    eager pass at a new length (cuDNN plans each new length for ~0.17 s, run 38d): the same chunks, the last one
    within 1e-5 RMS here (more left context than `vocoder_context`); earlier ones equal. An utterance shorter
    than its first window has no earlier mel and keeps its own length; `widen_vocoder_spans=False` keeps every
    span's own length."""
    from transformers import Qwen2_5OmniConfig

    from omnistage.families.qwen2_5_omni import models
    from omnistage.types import StageInput

    path, cpu = Path(tiny_qwen2_5_omni), torch.device("cpu")
    config = Qwen2_5OmniConfig.from_pretrained(path).token2wav_config
    model, voices = models.load_token2wav(path, config, cpu), models.load_voices(path)
    codes = torch.randint(0, config.dit_config.num_embeds - 1, (50,), generator=torch.Generator().manual_seed(0))

    def stream(decoder: models.Token2Wav, count: int) -> tuple[list[np.ndarray], list[int]]:
        """Codes one at a time; each ready step decodes what the decoder plans. Also the vocoder's mel lengths."""
        lengths: list[int] = []
        vocode = decoder.vocode
        decoder.vocode = lambda mel: lengths.append(mel.shape[-1]) or vocode(mel)
        inp, chunks = StageInput("r", [], params={"voice": VOICE, "seed": 0}, final=False), []
        for n in range(1, count + 1):
            inp.token_ids, inp.final = codes[:n].tolist(), n == count
            while decoder.ready(inp):
                ((tensors, finished),) = decoder.generate([inp])
                chunks.append(tensors["audio"].numpy())
                if finished:
                    return chunks, lengths
        return chunks, lengths

    def decoder(captured: bool, widen: bool = True) -> models.Token2Wav:
        decoder = models.Token2Wav(model, voices, cpu, window=24, first_window=12, widen_vocoder_spans=widen)
        if captured:
            decoder.vocoder_lengths = sorted({frames for _, frames in decoder.window_shapes()})
        return decoder

    (eager, eager_lengths), (widened, widened_lengths) = stream(decoder(False), 50), stream(decoder(True), 50)
    assert (eager_lengths, widened_lengths) == ([40, 80, 44], [40, 80, 80])  # the last window: 14 codes
    assert [len(c) for c in widened] == [len(c) for c in eager]
    for earlier, again in zip(eager[:-1], widened[:-1], strict=True):
        np.testing.assert_array_equal(again, earlier)
    assert np.sqrt(np.mean((widened[-1] - eager[-1]) ** 2) / np.mean(eager[-1] ** 2)) < 1e-5
    off, off_lengths = stream(decoder(True, widen=False), 50)  # the option off: as without graphs
    assert off_lengths == eager_lengths
    for chunk, again in zip(eager, off, strict=True):
        np.testing.assert_array_equal(again, chunk)
    short, short_lengths = stream(decoder(True), 8)
    assert short_lengths == [16] and len(short) == 1  # nothing earlier to widen onto
