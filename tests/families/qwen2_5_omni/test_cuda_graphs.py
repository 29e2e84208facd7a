"""CUDA graphs change no output. GPU only.

- The thinker's decode graphs (which also keep the hidden states the talker needs) and the talker's
  (which take its per-step embedding additions) give the same text and codes as eager steps: with
  token2wav eager in both runs, the audio is the same to the last bit.
- token2wav's captured flow-matching solves, replayed for other requests (other voices and codes)
  of the same window shapes, alone and in a batch split over several graphs, give the same audio as
  eager solves.
- token2wav's vocoder on its own stream beside the next window's solve gives the same audio, for one request
  and for requests streaming together.
- Inline stages, each on its own CUDA stream, give the same text, codes and audio as stages in their
  own processes.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from omnistage import Omni, SamplingParams
from omnistage.testing.sync import device_waits_raise
from omnistage.types import StageInput

pytest.importorskip("torchvision", reason="Qwen2.5-Omni's processor needs torchvision (installed by scripts/test)")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
WINDOWS = {"window": 8, "left": 8, "right": 4, "vocoder_context": 8}
# the same windows as deploy settings, with the DiT in float32 (the shipped configs' bfloat16 is for serving)
T2W = {"dtype": "float32", "options": {"window": 8}, "advanced": {"left": 8, "right": 4, "vocoder_context": 8}}


def test_ar_stage_graphs_keep_text_and_codes(tiny_qwen2_5_omni: str) -> None:
    prompts = [[{"role": "user", "content": f"Tell me about rivers, part {i}."}] for i in range(4)]
    params = [{"thinker": SamplingParams(max_tokens=6 + 3 * i, temperature=0, ignore_eos=True),
               "talker": SamplingParams(max_tokens=30 + 7 * i, temperature=0, repetition_penalty=1.05,
                                        ignore_eos=True)} for i in range(4)]
    results = {}
    for eager in (True, False):
        # float32: which requests share a prefill depends on thread timing, and in bfloat16 that alone can
        # flip a near-tied greedy token of this random model (seen once in four runs on the H200)
        stage = {"max_model_len": 512, "kv_cache_memory_gb": 0.25, "enforce_eager": eager, "dtype": "float32"}
        deploy = {"async_chunk": True, "worker_backend": "inline",
                  "stages": {"thinker": stage, "talker": stage,
                             "token2wav": {"enforce_eager": True, **T2W}}}
        with Omni(tiny_qwen2_5_omni, deploy) as omni:
            results[eager] = [omni.generate([p], ps, ("text", "audio"), voice=v)[0]
                              for p, ps, v in zip(prompts, params, ["Chelsie", "Ethan"] * 2, strict=True)]
            results[eager] += omni.generate(prompts[:2], params[0], ("text", "audio"))  # batches of two
    for i, (eager_out, graph_out) in enumerate(zip(results[True], results[False], strict=True)):
        assert eager_out.error is None and graph_out.error is None
        assert graph_out.token_ids == eager_out.token_ids
        assert graph_out.audio.shape == eager_out.audio.shape and eager_out.audio.size > 0
        if i < len(prompts):  # alone, token2wav decodes every window at batch 1: the same bits
            np.testing.assert_array_equal(graph_out.audio, eager_out.audio)
        else:  # the pair's windows share token2wav batches as they happen to arrive; cuBLAS rounds by batch size
            np.testing.assert_allclose(graph_out.audio, eager_out.audio, rtol=0, atol=1e-6)


def test_token2wav_graph_replays_equal_eager_solves(tiny_qwen2_5_omni: str) -> None:
    from transformers import Qwen2_5OmniConfig

    from omnistage.families.qwen2_5_omni import models

    path, device = Path(tiny_qwen2_5_omni), torch.device("cuda")
    config = Qwen2_5OmniConfig.from_pretrained(path).token2wav_config
    model, voices = models.load_token2wav(path, config, device), models.load_voices(path)
    generator = torch.Generator().manual_seed(0)
    requests = [(voice, torch.randint(0, config.dit_config.num_embeds - 1, (n,), generator=generator).tolist())
                for voice, n in (("Chelsie", 30), ("Ethan", 37), ("Ethan", 30))]

    def stream(decoder: models.Token2Wav, voice: str, codes: list[int]) -> np.ndarray:
        inp, chunks = StageInput("r", [], params={"voice": voice, "seed": 0}, final=False), []
        for n in range(1, len(codes) + 1):
            inp.token_ids, inp.final = codes[:n], n == len(codes)
            if decoder.ready(inp):
                ((tensors, _),) = decoder.generate([inp])
                chunks.append(tensors["audio"].numpy())
        return np.concatenate(chunks)

    eager = models.Token2Wav(model, voices, device, use_graphs=False, **WINDOWS)
    graphs = models.Token2Wav(model, voices, device, use_graphs=True, max_batch=4, **WINDOWS)
    graphs.warm_up()
    shapes = graphs.window_shapes()
    # tiny DiT blocks are 12 codes: windows start on a block at most 8 codes back, so later ones cycle
    # through 20, 28 and 24 codes (with their 4 of look-ahead)
    assert {codes for codes, _ in shapes} == {8 + 4, 20, 24, 28}
    assert set(graphs.solve.graphs) == {(b, codes) for b in (1, 2, 4) for codes, _ in shapes}
    assert graphs.solve_lengths == sorted({codes for codes, _ in shapes})  # shorter last windows join these
    assert set(graphs.vocode.graphs) == {(b, frames) for b in (1, 2, 4) for _, frames in shapes}
    for voice, codes in requests:
        expected, got = stream(eager, voice, codes), stream(graphs, voice, codes)
        assert got.shape == expected.shape
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)

    # A batch of three same-shape windows (replays of the 2- and 1-window graphs) equals each alone.
    def first_windows(decoder: models.Token2Wav) -> list[np.ndarray]:
        inputs = [StageInput(f"r{i}", codes[:12], params={"voice": voice, "seed": i}, final=False)
                  for i, (voice, codes) in enumerate(requests)]
        return [tensors["audio"].numpy() for tensors, _ in decoder.generate(inputs)]

    for got, expected in zip(first_windows(graphs), first_windows(eager), strict=True):
        assert got.size > 0
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("options", [WINDOWS, {"window": 12, "max_window": 24, "vocoder_context": 8}],
                         ids=["left_context", "kept_context"])
def test_token2wav_vocoder_beside_the_next_solve_keeps_the_audio(tiny_qwen2_5_omni: str, options: dict) -> None:
    """overlap_vocoder_max_batch: every window of a request launched before any audio is collected (each solve queued
    while earlier vocoder passes may still run on their own stream) gives the audio each window waited for."""
    from transformers import Qwen2_5OmniConfig

    from omnistage.families.qwen2_5_omni import models

    path, device = Path(tiny_qwen2_5_omni), torch.device("cuda")
    config = Qwen2_5OmniConfig.from_pretrained(path).token2wav_config
    model, voices = models.load_token2wav(path, config, device), models.load_voices(path)
    codes = torch.randint(0, config.dit_config.num_embeds - 1, (61,), generator=torch.Generator().manual_seed(0))

    def stream(decoder: models.Token2Wav) -> np.ndarray:
        decoder.warm_up()
        inp, flights = StageInput("r", [], params={"voice": "Ethan", "seed": 0}, final=False), []
        for n in range(1, len(codes) + 1):
            inp.token_ids, inp.final = codes[:n].tolist(), n == len(codes)
            if decoder.ready(inp):
                flights.append(decoder.launch([inp]))
        assert flights[-1].finished == [True] and len(flights) > 3
        return np.concatenate([flight.collect()[0]["audio"].numpy() for flight in flights])

    def first_windows(decoder: models.Token2Wav) -> list[np.ndarray]:
        """One request's first window (overlapped), then three others' in one batch (above the limit: busy until
        its audio is out), launched before the first is collected: one vocoder length, one set of graph buffers."""
        inputs = [StageInput(f"f{i}", codes[i : i + 30].tolist(), params={"voice": "Chelsie", "seed": i}, final=False)
                  for i in range(4)]
        flights = [decoder.launch(inputs[:1]), decoder.launch(inputs[1:])]
        assert (flights[0].busy is not flights[0].done) == bool(decoder.overlap_vocoder_max_batch)
        assert flights[1].busy is flights[1].done
        return [tensors["audio"].numpy() for flight in flights for tensors in flight.collect()]

    waited = models.Token2Wav(model, voices, device, overlap_vocoder_max_batch=0, **options)
    beside = models.Token2Wav(model, voices, device, overlap_vocoder_max_batch=1, **options)
    expected, got = stream(waited), stream(beside)
    assert waited._side is None and beside._side is not None  # the vocoder had a stream of its own
    assert beside._side[1].priority == torch.cuda.current_stream().priority
    assert got.shape == expected.shape and got.size > 0
    np.testing.assert_array_equal(got, expected)
    for got, expected in zip(first_windows(beside), first_windows(waited), strict=True):
        assert got.size > 0
        np.testing.assert_array_equal(got, expected)


def test_concurrent_streamed_requests_keep_their_audio_with_the_vocoder_beside(tiny_qwen2_5_omni: str) -> None:
    """Four requests streaming windows together, token2wav's vocoder on its own stream (single windows beside
    the next solve, larger batches after): each request's audio equals its solo run's."""
    prompts = [[{"role": "user", "content": f"Tell me about lakes, part {i}."}] for i in range(4)]
    params = [{"thinker": SamplingParams(max_tokens=5 + 2 * i, temperature=0, ignore_eos=True),
               "talker": SamplingParams(max_tokens=40 + 9 * i, temperature=0, repetition_penalty=1.05,
                                        ignore_eos=True)} for i in range(4)]
    voices = ["Chelsie", "Ethan"] * 2
    stage = {"max_model_len": 512, "kv_cache_memory_gb": 0.25, "dtype": "float32"}
    deploy = {"async_chunk": True, "worker_backend": "inline",
              "stages": {"thinker": stage, "talker": stage,
                         "token2wav": {**T2W, "advanced": {**T2W["advanced"], "overlap_vocoder_max_batch": 1}}}}
    with Omni(tiny_qwen2_5_omni, deploy) as omni:
        solo = [omni.generate([p], ps, ("text", "audio"), voice=v)[0]
                for p, ps, v in zip(prompts, params, voices, strict=True)]
        together = [None] * 4

        def run(i: int) -> None:
            together[i] = omni.generate([prompts[i]], params[i], ("text", "audio"), voice=voices[i])[0]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        steps = omni.stats()["token2wav"]["num_steps"]
    assert steps > 4  # windows, not one decode per request
    for a, b in zip(solo, together, strict=True):
        assert a.error is None and b.error is None and a.token_ids == b.token_ids
        assert a.audio.shape == b.audio.shape and a.audio.size > 0
        np.testing.assert_allclose(b.audio, a.audio, rtol=1e-4, atol=1e-5)  # batch sizes differ: cuBLAS rounding


def test_inline_stage_streams_equal_stage_processes(tiny_qwen2_5_omni: str) -> None:
    """Inline stages share the GPU on three streams and hand the thinker's states to the talker on the
    device; process stages hand them over through shared memory. Four concurrent requests, same outputs."""
    prompts = [[{"role": "user", "content": f"Tell me about mountains, part {i}."}] for i in range(4)]
    params = {"thinker": SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
              "talker": SamplingParams(max_tokens=40, temperature=0, repetition_penalty=1.05, ignore_eos=True)}
    results = {}
    for backend in ("inline", "process"):
        # float32, as above: the four requests share thinker batches as their threads happen to run, and in
        # bfloat16 a batch of another size flipped the thinker's second greedy token (5 of 8 runs, run 41b)
        stage = {"max_model_len": 512, "kv_cache_memory_gb": 0.25, "devices": "0", "dtype": "float32"}
        deploy = {"async_chunk": True, "worker_backend": backend,
                  "stages": {"thinker": stage, "talker": stage, "token2wav": {"devices": "0", **T2W}}}
        with Omni(tiny_qwen2_5_omni, deploy) as omni:
            results[backend] = omni.generate(prompts, params, ("text", "audio"))
            if backend == "inline":  # decoding stages' streams are favoured by the GPU's block scheduler
                priority = {name: workers[0].stream.priority for name, workers in omni.orchestrator.workers.items()}
                assert priority["thinker"] == priority["talker"] < priority["token2wav"] == 0, priority
    for inline, process in zip(results["inline"], results["process"], strict=True):
        assert inline.error is None and process.error is None
        assert inline.token_ids == process.token_ids and inline.audio.size > 0
        np.testing.assert_allclose(inline.audio, process.audio, rtol=0, atol=1e-5)


def test_batch_graphs_fall_back_to_eager_when_a_capture_fails() -> None:
    """A function that syncs with the host cannot be captured: its length runs eagerly, with the right
    results; a capturable one replays a batch of three as 2 + 1."""
    from omnistage.engine.generation.graphs import BatchGraphs

    def syncs(x: torch.Tensor) -> torch.Tensor:
        return x * float(x.sum().item() != 0)

    ones = torch.ones(3, 8, device="cuda")
    broken = BatchGraphs(syncs, max_batch=4)
    assert broken.capture(ones[:1]) is False and not broken.graphs
    assert torch.equal(broken(ones), ones)
    doubling = BatchGraphs(lambda x: x * 2, max_batch=4)
    assert doubling.capture(ones[:1]) and set(doubling.graphs) == {(1, 8), (2, 8), (4, 8)}
    assert torch.equal(doubling(ones * torch.arange(3, device="cuda")[:, None]),
                       2 * ones * torch.arange(3, device="cuda")[:, None])
    # one length's graphs read one set of input buffers (views for smaller batches); tuple outputs
    inputs = {batch: static[0] for (batch, _), (_, static, _) in doubling.graphs.items()}
    assert inputs[1].data_ptr() == inputs[2].data_ptr() == inputs[4].data_ptr()
    both = BatchGraphs(lambda x: (x * 2, x.sum(-1)), max_batch=4)
    assert both.capture(ones[:1])
    rows = ones * torch.arange(3, device="cuda")[:, None]
    doubled, sums = both(rows)
    assert torch.equal(doubled, 2 * rows) and torch.equal(sums, rows.sum(-1))


def test_first_inputs_are_prepared_without_waiting_for_the_device(tiny_qwen2_5_omni: str) -> None:
    """A new request's thinker and talker inputs are prepared on the stage's thread while its previous step may
    still run on the GPU: nothing in it may wait for the device (a pageable copy, a `.item()`), or every request
    admitted under load costs a whole step."""
    from omnistage.config.deploy import load_deploy_config
    from omnistage.families.qwen2_5_omni import thinker_to_talker
    from omnistage.families.registry import detect_family
    from omnistage.types import OmniRequest

    family, info = detect_family(Path(tiny_qwen2_5_omni))
    pipeline = family.pipeline(info, load_deploy_config({"stages": {"*": {"max_model_len": 256}}}))
    thinker, talker = pipeline.build_engine("thinker"), pipeline.build_engine("talker")
    request = OmniRequest(request_id="r", messages=[{"role": "user", "content": "Hello there."}],
                          output_modalities=("text", "audio"))
    inp = pipeline.preprocess(request)
    try:
        with device_waits_raise():
            prepared = thinker.runner.model.prepare_input(inp, first=True)
        thinker.add_request(prepared)  # the engine's own step may sync (sampling); the hand-off input is real
        talker_inp = None
        while talker_inp is None:  # the talker opens once the first reply token's states exist
            for out in thinker.step():
                talker_inp = thinker_to_talker(pipeline, request, out) or talker_inp
        torch.cuda.synchronize()
        with device_waits_raise():
            talker.runner.model.prepare_input(talker_inp, first=True)
    finally:
        thinker.shutdown()
        talker.shutdown()
