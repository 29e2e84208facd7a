"""The 12 Hz speech tokenizer's decoder (code frames -> 24 kHz audio), loaded from `speech_tokenizer/`.

Architecture notes: docs/families/qwen3_tts.md. The conv, SnakeBeta, ConvNeXt and transformer-layer blocks
are transformers' Qwen3-Omni code2wav classes (same computation); the split RVQ, `pre_conv` and the
transformer's input/output projections are specific to this decoder and built here, with parameter names
matching the checkpoint so `load_state_dict(strict=True)` checks the layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field
from safetensors.torch import load_file
from torch import nn
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeCausalConvNet,
    Qwen3OmniMoeCausalTransConvNet,
    Qwen3OmniMoeCode2WavDecoderBlock,
    Qwen3OmniMoeCode2WavTransformerLayer,
    Qwen3OmniMoeConvNeXtBlock,
    Qwen3OmniMoeRMSNorm,
    Qwen3OmniMoeRotaryEmbedding,
    Qwen3OmniMoeSnakeBeta,
)

from omnistage.engine.generation.engine import Results
from omnistage.types import StageInput

_DECODER_FIELDS = (
    "codebook_size", "hidden_size", "max_position_embeddings", "rope_theta", "num_attention_heads",
    "num_key_value_heads", "attention_bias", "sliding_window", "intermediate_size", "hidden_act",
    "layer_scale_initial_scale", "rms_norm_eps", "num_hidden_layers", "num_quantizers", "upsample_rates",
    "upsampling_ratios", "decoder_dim", "attention_dropout", "head_dim",
)  # fields shared with Qwen3OmniMoeCode2WavConfig; latent_dim and codebook_dim are this decoder's own


def _right_trim(conv: Qwen3OmniMoeCausalTransConvNet) -> Qwen3OmniMoeCausalTransConvNet:
    # Qwen3-Omni trims (k - s) samples on BOTH sides; this decoder trims all of them on the right, which is
    # what makes it causal (frame t's samples see only frames <= t) and windowed streaming exact.
    conv.left_pad, conv.right_pad = 0, conv.conv.kernel_size[0] - conv.conv.stride[0]
    return conv


class _Codebook(nn.Module):
    def __init__(self, dim: int, size: int) -> None:
        super().__init__()
        self.cluster_usage = nn.Parameter(torch.ones(size))
        self.embedding_sum = nn.Parameter(torch.zeros(size, dim))

    def table(self) -> torch.Tensor:
        # EMA codebook: the entry is the running sum over its usage count (clamped as in training).
        return self.embedding_sum / self.cluster_usage.clamp(min=1e-5)[:, None]


class _VQ(nn.Module):
    def __init__(self, dim: int, size: int) -> None:
        super().__init__()
        self._codebook = _Codebook(dim, size)


class _RVQ(nn.Module):
    """Sum of `n_q` codebook lookups, then a 1x1 conv to the output width."""

    def __init__(self, n_q: int, dim: int, out_dim: int, size: int) -> None:
        super().__init__()
        self.vq = nn.Module()
        self.vq.layers = nn.ModuleList(_VQ(dim, size) for _ in range(n_q))
        self.input_proj = nn.Conv1d(out_dim, dim, 1, bias=False)  # encode side; kept so loading is strict
        self.output_proj = nn.Conv1d(dim, out_dim, 1, bias=False)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:  # [B, n_q, T] -> [B, out_dim, T]
        x = sum(nn.functional.embedding(codes[:, i], layer._codebook.table()) for i, layer in enumerate(self.vq.layers))
        return self.output_proj(x.transpose(1, 2))


class _Quantizer(nn.Module):
    """Codebook 0 (semantic) and codebooks 1.. (acoustic) are separate RVQs whose outputs add."""

    def __init__(self, n_q: int, codebook_dim: int, size: int) -> None:
        super().__init__()
        self.rvq_first = _RVQ(1, codebook_dim // 2, codebook_dim, size)
        self.rvq_rest = _RVQ(n_q - 1, codebook_dim // 2, codebook_dim, size)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        return self.rvq_first(codes[:, :1]) + self.rvq_rest(codes[:, 1:])


class _Transformer(nn.Module):
    def __init__(self, cfg: Qwen3OmniMoeCode2WavConfig, latent_dim: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Qwen3OmniMoeCode2WavTransformerLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = Qwen3OmniMoeRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.rotary_emb = Qwen3OmniMoeRotaryEmbedding(config=cfg)
        self.input_proj = nn.Linear(latent_dim, cfg.hidden_size)
        self.output_proj = nn.Linear(cfg.hidden_size, latent_dim)
        self.window = cfg.sliding_window

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, latent]
        t = x.shape[1]
        h = self.input_proj(x)
        pos = torch.arange(t, device=x.device)[None]
        q, k = pos[0, :, None], pos[0, None, :]
        allowed = (k <= q) & (q - k < self.window)  # causal sliding window, as HF's sliding mask
        mask = torch.zeros(t, t, dtype=h.dtype, device=x.device).masked_fill(~allowed, torch.finfo(h.dtype).min)
        cos_sin = self.rotary_emb(h, pos)
        for layer in self.layers:
            h = layer(h, attention_mask=mask[None, None], position_ids=pos, position_embeddings=cos_sin)
        return self.output_proj(self.norm(h))


class CodecDecoder(nn.Module):
    """`forward(codes [B, Q, T]) -> wav [B, 1, T * upsample]`; causal, so frame t's samples see frames <= t."""

    def __init__(self, decoder_config: dict) -> None:
        super().__init__()
        cfg = Qwen3OmniMoeCode2WavConfig(**{k: decoder_config[k] for k in _DECODER_FIELDS if k in decoder_config})
        cfg._attn_implementation = "eager"
        latent, cb_dim = decoder_config["latent_dim"], decoder_config["codebook_dim"]
        self.num_quantizers = cfg.num_quantizers
        self.upsample_factor = int(torch.tensor([*cfg.upsample_rates, *cfg.upsampling_ratios]).prod())
        self.quantizer = _Quantizer(cfg.num_quantizers, cb_dim, cfg.codebook_size)
        self.pre_conv = Qwen3OmniMoeCausalConvNet(cb_dim, latent, kernel_size=3)
        self.pre_transformer = _Transformer(cfg, latent)
        self.upsample = nn.ModuleList(
            nn.ModuleList(
                [_right_trim(Qwen3OmniMoeCausalTransConvNet(latent, latent, f, f)), Qwen3OmniMoeConvNeXtBlock(latent)]
            )
            for f in cfg.upsampling_ratios
        )
        blocks = [Qwen3OmniMoeCode2WavDecoderBlock(cfg, i) for i in range(len(cfg.upsample_rates))]
        for block in blocks:
            _right_trim(block.block[1])  # [SnakeBeta, transposed conv, 3 residual units]
        out_dim = cfg.decoder_dim // 2 ** len(cfg.upsample_rates)
        self.decoder = nn.ModuleList(
            [
                Qwen3OmniMoeCausalConvNet(latent, cfg.decoder_dim, 7),
                *blocks,
                Qwen3OmniMoeSnakeBeta(out_dim),
                Qwen3OmniMoeCausalConvNet(out_dim, 1, 7),
            ]
        )

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        if codes.shape[1] != self.num_quantizers:
            raise ValueError(f"expected {self.num_quantizers} codebooks, got {codes.shape[1]}")
        h = self.pre_conv(self.quantizer(codes)).transpose(1, 2)
        h = self.pre_transformer(h).transpose(1, 2)
        for blocks in self.upsample:
            for block in blocks:
                h = block(h)
        for block in self.decoder:
            h = block(h)
        return h.clamp(-1, 1)

    @property
    def receptive_field(self) -> int:
        """Frames of left history one frame's samples depend on: the transformer's layers x (window - 1) (each
        layer looks window - 1 frames back) plus the convs' tails (pre-conv 2 frames, the ConvNeXt, decoder and
        residual convs about 10 more at their rates), rounded up. Streaming with this much left context is exact;
        the real checkpoint's 8 layers x 72 make it far longer than the authors' 25-frame context."""
        t = self.pre_transformer
        return len(t.layers) * (t.window - 1) + 12

    @torch.inference_mode()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Batched one-shot decode: codes [B, Q, T] (same T) -> wav [B, T * upsample_factor]."""
        return self(codes).squeeze(1)

    @torch.inference_mode()
    def decode_window(self, codes: torch.Tensor, start: int, left_context: int) -> torch.Tensor:
        """Samples of frames `start..` from a decode over `codes[..., start - ctx:]`, ctx = min(start, left_context).

        Exact vs one-shot when ctx covers the receptive field; bounded otherwise (the transformer's window
        dominates it, see the doc)."""
        ctx = min(start, left_context)
        wav = self(codes[..., start - ctx :]).squeeze(1)
        return wav[:, ctx * self.upsample_factor :]

    def stream(self, codes: torch.Tensor, window: int, left_context: int) -> list[torch.Tensor]:
        """Decode in windows of `window` frames, as a streaming stage would emit them."""
        starts = range(0, codes.shape[-1], window)
        return [self.decode_window(codes[..., : s + window], s, left_context) for s in starts]


def load_codec_decoder(speech_tokenizer_dir: str | Path, dtype: torch.dtype = torch.float32) -> CodecDecoder:
    """Build the decoder from `speech_tokenizer/config.json` and its safetensors (keys `decoder.*`)."""
    root = Path(speech_tokenizer_dir)
    config = json.loads((root / "config.json").read_text(encoding="utf-8"))
    model = CodecDecoder(config["decoder_config"])
    state: dict[str, torch.Tensor] = {}
    for f in sorted(root.glob("*.safetensors")):
        state.update({k[len("decoder.") :]: v for k, v in load_file(f).items() if k.startswith("decoder.")})
    model.load_state_dict(state, strict=True)
    return model.to(dtype).eval()


class CodecOptions(BaseModel):
    """`stages.codec.options`: how a streamed request's audio is cut into chunks while frames still arrive.
    Smaller windows lower first-packet latency but cost more decodes; `left_context` >= the receptive field
    (see `CodecDecoder.receptive_field`) makes each window exact, less trades accuracy for compute."""

    model_config = ConfigDict(extra="forbid", strict=True)

    first_window: int = Field(4, ge=1, description="frames (12.5 a second) in a streamed request's first chunk")
    window: int = Field(12, ge=1, description="frames per later streamed chunk")
    left_context: int = Field(25, ge=0, description="earlier frames decoded again with each window")


class CodecStage:
    """The generation engine's model for the codec stage. A request's frames ([T, Q] in `tensors["codes"]`, grown
    by chunks) decode whole at the end (`params["stream"]` False) or in windows (`first_window`, then `window`
    frames, each with `left_context` frames before it); `params["done"]` is the frames already emitted (it may
    start > 0: ICL reference frames, left context only). All windows of one step decode in one forward."""

    def __init__(self, decoder: CodecDecoder, device: torch.device, first_window: int = 4, window: int = 12,
                 left_context: int = 25) -> None:
        self.decoder, self.device = decoder, device
        self.first_window, self.window, self.left_context = first_window, window, left_context

    @staticmethod
    def _frames(inp: StageInput) -> int:
        codes = inp.tensors.get("codes")
        return 0 if codes is None else codes.shape[0]

    def _end(self, inp: StageInput) -> int:
        """Last frame (exclusive) to decode now: all on the final chunk, else whole windows only."""
        n, done = self._frames(inp), inp.params["done"]
        if inp.final:
            return n
        if not inp.params.get("stream", False):
            return done
        if not inp.params.get("started"):  # the first chunk is exactly first_window frames: quick to decode
            return done + self.first_window if n - done >= self.first_window else done
        return done + (n - done) // self.window * self.window  # whole windows only; a late step catches up

    def ready(self, inp: StageInput) -> bool:
        return inp.final or self._end(inp) > inp.params["done"]

    def generate(self, inputs: list[StageInput]) -> Results:
        # Rows start at their context start and are right-padded to the longest: the decoder is causal (left
        # padding, right-trimmed transposed convs), so padding after a row never reaches its valid samples.
        rows = []
        for inp in inputs:
            end, done = self._end(inp), inp.params["done"]
            ctx = done if not inp.params.get("stream", False) else min(done, self.left_context)
            rows.append((done - ctx, ctx, end))
        longest = max((end - start for start, _, end in rows), default=0)
        wav = None
        if longest > 0:
            q = self.decoder.num_quantizers
            batch = torch.zeros(len(inputs), q, longest, dtype=torch.long)
            for i, (inp, (start, _, end)) in enumerate(zip(inputs, rows, strict=True)):
                if end > start:
                    batch[i, :, : end - start] = inp.tensors["codes"][start:end].T
            wav = self.decoder.decode(batch.to(self.device)).float().cpu()
        up = self.decoder.upsample_factor
        results: Results = []
        for i, (inp, (start, ctx, end)) in enumerate(zip(inputs, rows, strict=True)):
            done = inp.params["done"]
            audio = wav[i, ctx * up : (end - start) * up].clone() if wav is not None and end > done else torch.zeros(0)
            if end > done:
                inp.params["started"] = True
            inp.params["done"] = end
            results.append(({"audio": audio}, inp.final and end == self._frames(inp)))
        return results
