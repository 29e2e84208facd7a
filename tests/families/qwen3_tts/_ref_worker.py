"""Runs inside .venvs/qwen-tts (transformers 4.57.3 + qwen-tts); driven by reference.py over JSON.

argv[1] is a JSON request file; the reply is written to argv[2]. Arrays travel as .npy files."""

import json
import sys

import numpy as np
import torch


def make_speech_tokenizer(req: dict) -> dict:
    # A tiny random 12 Hz tokenizer saved by the package itself: the layout the checkpoint ships.
    from qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Config
    from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Model

    torch.manual_seed(req["seed"])
    cfg = Qwen3TTSTokenizerV2Config(encoder_config=req["encoder_config"], decoder_config=req["decoder_config"],
                                    encoder_valid_num_quantizers=req["decoder_config"]["num_quantizers"])
    model = Qwen3TTSTokenizerV2Model(cfg).eval()
    with torch.no_grad():
        for name, p in model.decoder.named_parameters():
            if name.endswith("embedding_sum"):
                p.normal_(0.0, 1.0)
            elif name.endswith("cluster_usage"):
                p.uniform_(0.5, 2.0)
            elif p.ndim >= 2:
                p.normal_(0.0, p[0].numel() ** -0.5)  # unit-gain layers: std-0.02 init decays to ~1e-8 output
            elif name.endswith((".scale", ".gamma")):
                p.fill_(0.5)  # default LayerScale/ConvNeXt gains (1e-2, 1e-6) would hide those blocks
    model.save_pretrained(req["out"], safe_serialization=True)
    return {"ok": True}


def decode(req: dict) -> dict:
    from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Model

    model = Qwen3TTSTokenizerV2Model.from_pretrained(req["dir"], attn_implementation="eager").eval()
    codes = torch.from_numpy(np.load(req["codes"]))  # [B, Q, T]
    with torch.no_grad():
        wav = model.decoder(codes) if req.get("one_shot", True) else model.decoder.chunked_decode(codes)
    np.save(req["wav"], wav.squeeze(1).float().numpy())
    return {"ok": True, "upsample": int(model.decoder.total_upsample)}


def generate(req: dict) -> dict:
    # CustomVoice / VoiceDesign generation through the package's own loader and prompt construction, one request at
    # a time
    # (the package left-pads a batch); returns each request's frames [T, Q] (the eos frame excluded).
    from qwen_tts import Qwen3TTSModel

    tts = Qwen3TTSModel.from_pretrained(req["dir"], dtype=torch.float32, attn_implementation=req.get("attn", "sdpa"))
    out = {}
    for i, item in enumerate(req["items"]):
        ids = tts._tokenize_texts([tts._build_assistant_text(item["text"])])
        kwargs = tts._merge_generate_kwargs(**req["params"])
        instruct = tts._tokenize_texts([tts._build_instruct_text(item["instruct"])]) if item.get("instruct") \
            else [None]
        codes, _ = tts.model.generate(input_ids=ids, instruct_ids=instruct, languages=[item.get("language", "Auto")],
                                      speakers=[item.get("speaker")],
                                      non_streaming_mode=req.get("non_streaming_mode", True), **kwargs)
        np.save(f"{req['out']}/codes{i}.npy", codes[0].numpy())
        out[str(i)] = [int(t) for t in ids[0][0]]
        if instruct[0] is not None:
            out[f"{i}-instruct"] = [int(t) for t in instruct[0][0]]
    return {"ok": True, "input_ids": out}


def clone(req: dict) -> dict:
    # Base voice clone through the package's own prompt builder (create_voice_clone_prompt: speaker encoder + speech
    # tokenizer encode) and generate, one request at a time; per item: the x-vector, the ref codes (ICL), the frames
    # [T, Q] (eos excluded) and generate_voice_clone's waveform (ref + generated decoded, the ref fraction cut).
    from qwen_tts import Qwen3TTSModel

    tts = Qwen3TTSModel.from_pretrained(req["dir"], dtype=torch.float32, attn_implementation="sdpa")
    for i, item in enumerate(req["items"]):
        audio = np.load(item["audio"]).astype(np.float32)
        xvec_only = bool(item.get("x_vector_only_mode", False))
        (prompt,) = tts.create_voice_clone_prompt(ref_audio=(audio, 24000), ref_text=item.get("ref_text"),
                                                  x_vector_only_mode=xvec_only)
        np.save(f"{req['out']}/xvec{i}.npy", prompt.ref_spk_embedding.float().numpy())
        if prompt.ref_code is not None:
            np.save(f"{req['out']}/ref{i}.npy", prompt.ref_code.numpy())
        kwargs = tts._merge_generate_kwargs(**req["params"])
        ids = tts._tokenize_texts([tts._build_assistant_text(item["text"])])
        ref_ids = [tts._tokenize_texts([tts._build_ref_text(item["ref_text"])])[0]] if item.get("ref_text") \
            else [None]
        codes, _ = tts.model.generate(input_ids=ids, ref_ids=ref_ids,
                                      voice_clone_prompt=tts._prompt_items_to_voice_clone_prompt([prompt]),
                                      languages=[item.get("language", "Auto")],
                                      non_streaming_mode=item.get("non_streaming_mode", False), **kwargs)
        np.save(f"{req['out']}/codes{i}.npy", codes[0].numpy())
        wavs, _ = tts.generate_voice_clone(text=item["text"], language=item.get("language", "Auto"),
                                           voice_clone_prompt=[prompt],
                                           non_streaming_mode=item.get("non_streaming_mode", False),
                                           **req["params"])
        np.save(f"{req['out']}/wav{i}.npy", np.asarray(wavs[0], dtype=np.float32))
    return {"ok": True}


def load_info(req: dict) -> dict:
    # The package's loaders on a checkpoint: weights the models lack (missing) or the files hold unused (unexpected)
    from qwen_tts.core.models import Qwen3TTSForConditionalGeneration
    from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Model

    # (the class's own from_pretrained also attaches the speech tokenizer and drops the loading info: its base's)
    cls = Qwen3TTSForConditionalGeneration
    _, info = super(cls, cls).from_pretrained(req["dir"], output_loading_info=True)
    _, tok = Qwen3TTSTokenizerV2Model.from_pretrained(f"{req['dir']}/speech_tokenizer", output_loading_info=True)
    return {k: sorted(info[k]) + sorted(tok[k]) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")}


if __name__ == "__main__":
    request = json.loads(open(sys.argv[1]).read())
    ops = {"make_speech_tokenizer": make_speech_tokenizer, "decode": decode, "generate": generate, "clone": clone,
           "load_info": load_info}
    reply = ops[request["op"]](request)
    open(sys.argv[2], "w").write(json.dumps(reply))
