"""Qwen3-TTS Base voice clone: the speaker encoder (ECAPA-TDNN over a log-mel of the reference audio -> x-vector).

Same computation as the reference package's `extract_speaker_embedding`: a 128-bin log-mel at 24 kHz (n_fft 1024,
hop 256, win 1024, reflect padding of (n_fft - hop) / 2 each side, no centring, magnitude sqrt(re^2 + im^2 + 1e-9),
Slaney-scale, Slaney-normalised triangular filters up to fmax 12000, log with a floor of 1e-5) into an ECAPA-TDNN
whose parameter names are the checkpoint's `speaker_encoder.*`. The filterbank is built here in float64 as librosa's
`filters.mel` builds it, so librosa is not needed at run time.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

SAMPLE_RATE = 24000
MEL = dict(n_fft=1024, n_mels=128, hop=256, win=1024, fmin=0.0, fmax=12000.0)


def _hz_to_mel(f: np.ndarray) -> np.ndarray:
    """Slaney's mel scale: linear below 1 kHz, logarithmic above."""
    f = np.asarray(f, dtype=np.float64)
    mel = f / (200.0 / 3)
    log = f >= 1000.0
    return np.where(log, 15.0 + np.log(np.maximum(f, 1e-10) / 1000.0) / (math.log(6.4) / 27.0), mel)


def _mel_to_hz(m: np.ndarray) -> np.ndarray:
    m = np.asarray(m, dtype=np.float64)
    return np.where(m >= 15.0, 1000.0 * np.exp((math.log(6.4) / 27.0) * (m - 15.0)), m * (200.0 / 3))


def mel_filterbank(sr: int = SAMPLE_RATE, n_fft: int = 1024, n_mels: int = 128, fmin: float = 0.0,
                   fmax: float = 12000.0) -> torch.Tensor:
    """[n_mels, n_fft // 2 + 1] float32: triangular filters between Slaney-mel-spaced edges, each scaled by
    2 / (its band width in Hz) (Slaney normalisation), as librosa.filters.mel(norm="slaney", htk=False)."""
    freqs = np.linspace(0.0, sr / 2.0, n_fft // 2 + 1)
    edges = _mel_to_hz(np.linspace(_hz_to_mel(fmin), _hz_to_mel(fmax), n_mels + 2))
    widths = np.diff(edges)
    ramps = edges[:, None] - freqs[None, :]
    lower = -ramps[:-2] / widths[:-1, None]
    upper = ramps[2:] / widths[1:, None]
    weights = np.maximum(0.0, np.minimum(lower, upper)) * (2.0 / (edges[2:] - edges[:-2]))[:, None]
    return torch.from_numpy(weights.astype(np.float32))


def log_mel(audio: torch.Tensor, basis: torch.Tensor | None = None) -> torch.Tensor:
    """[frames, 128] log-mel of mono 24 kHz audio [samples] (float32)."""
    n_fft, hop, win = MEL["n_fft"], MEL["hop"], MEL["win"]
    basis = mel_filterbank() if basis is None else basis
    pad = (n_fft - hop) // 2
    y = F.pad(audio.float()[None, None], (pad, pad), mode="reflect")[0]
    spec = torch.stft(y, n_fft, hop_length=hop, win_length=win, window=torch.hann_window(win, device=y.device),
                      center=False, normalized=False, onesided=True, return_complex=True)
    mag = torch.sqrt(torch.view_as_real(spec).pow(2).sum(-1) + 1e-9)
    return torch.log(torch.clamp(basis.to(mag.device) @ mag, min=1e-5))[0].T


def _conv(cin: int, cout: int, k: int = 1, d: int = 1) -> nn.Conv1d:
    return nn.Conv1d(cin, cout, k, dilation=d, padding="same", padding_mode="reflect")


class _TDNN(nn.Module):
    def __init__(self, cin: int, cout: int, k: int, d: int) -> None:
        super().__init__()
        self.conv = _conv(cin, cout, k, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv(x))


class _Res2Net(nn.Module):
    """Channels split in `scale` groups; group 0 passes through, group i>1 is conv'd after adding group i-1's out."""

    def __init__(self, channels: int, scale: int, k: int, d: int) -> None:
        super().__init__()
        self.scale = scale
        self.blocks = nn.ModuleList(_TDNN(channels // scale, channels // scale, k, d) for _ in range(scale - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs: list[torch.Tensor] = []
        for i, part in enumerate(torch.chunk(x, self.scale, dim=1)):
            outs.append(part if i == 0 else self.blocks[i - 1](part if i == 1 else part + outs[-1]))
        return torch.cat(outs, dim=1)


class _SE(nn.Module):
    def __init__(self, channels: int, se: int) -> None:
        super().__init__()
        self.conv1, self.conv2 = _conv(channels, se), _conv(se, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(self.conv2(F.relu(self.conv1(x.mean(dim=2, keepdim=True)))))


class _SERes2NetBlock(nn.Module):
    def __init__(self, cin: int, cout: int, scale: int, se: int, k: int, d: int) -> None:
        super().__init__()
        self.tdnn1 = _TDNN(cin, cout, 1, 1)
        self.res2net_block = _Res2Net(cout, scale, k, d)
        self.tdnn2 = _TDNN(cout, cout, 1, 1)
        self.se_block = _SE(cout, se)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.se_block(self.tdnn2(self.res2net_block(self.tdnn1(x))))


class _AttentivePooling(nn.Module):
    """Mean and std over time weighted by a per-channel softmax attention that also sees the global statistics."""

    def __init__(self, channels: int, attention: int) -> None:
        super().__init__()
        self.tdnn = _TDNN(channels * 3, attention, 1, 1)
        self.conv = _conv(attention, channels)

    @staticmethod
    def _stats(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean = (w * x).sum(2)
        return mean, torch.sqrt((w * (x - mean[..., None]).pow(2)).sum(2).clamp(1e-12))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[-1]
        mean, std = self._stats(x, x.new_full((1, 1, t), 1.0 / t))
        ctx = torch.cat([x, mean[..., None].expand(-1, -1, t), std[..., None].expand(-1, -1, t)], dim=1)
        attn = torch.softmax(self.conv(torch.tanh(self.tdnn(ctx))), dim=2)
        mean, std = self._stats(x, attn)
        return torch.cat([mean, std], dim=1)[..., None]


class SpeakerEncoder(nn.Module):
    """ECAPA-TDNN: a TDNN, SE-Res2Net blocks, multi-layer aggregation (`mfa`), attentive pooling (`asp`), `fc`."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        ch = cfg.get("enc_channels", [512, 512, 512, 512, 1536])
        ks = cfg.get("enc_kernel_sizes", [5, 3, 3, 3, 1])
        ds = cfg.get("enc_dilations", [1, 2, 3, 4, 1])
        scale, se = cfg.get("enc_res2net_scale", 8), cfg.get("enc_se_channels", 128)
        self.blocks = nn.ModuleList([_TDNN(cfg.get("mel_dim", 128), ch[0], ks[0], ds[0])])
        self.blocks.extend(_SERes2NetBlock(ch[i - 1], ch[i], scale, se, ks[i], ds[i]) for i in range(1, len(ch) - 1))
        self.mfa = _TDNN(ch[-1], ch[-1], ks[-1], ds[-1])
        self.asp = _AttentivePooling(ch[-1], cfg.get("enc_attention_channels", 128))
        self.fc = _conv(ch[-1] * 2, cfg.get("enc_dim", 1024))

    def forward(self, mels: torch.Tensor) -> torch.Tensor:
        """x-vectors [B, enc_dim] of log-mels [B, frames, mel_dim]."""
        h, outs = mels.transpose(1, 2), []
        for block in self.blocks:
            h = block(h)
            outs.append(h)
        return self.fc(self.asp(self.mfa(torch.cat(outs[1:], dim=1))))[..., 0]


def load_speaker_encoder(root: str | Path, cfg: dict[str, Any], device: torch.device | str = "cpu",
                         dtype: torch.dtype = torch.float32) -> SpeakerEncoder:
    """The checkpoint's `speaker_encoder.*` weights (safetensors, every file of the root), loaded strictly."""
    state: dict[str, torch.Tensor] = {}
    for file in sorted(Path(root).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            state |= {k[len("speaker_encoder."):]: f.get_tensor(k) for k in f.keys()
                      if k.startswith("speaker_encoder.")}
    model = SpeakerEncoder(cfg)
    model.load_state_dict(state, strict=True)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


@torch.inference_mode()
def x_vector(encoder: SpeakerEncoder, audio: np.ndarray | torch.Tensor) -> torch.Tensor:
    """The x-vector [enc_dim] (CPU float32) of mono 24 kHz audio."""
    p = next(encoder.parameters())
    mels = log_mel(torch.as_tensor(np.asarray(audio, dtype=np.float32)))[None]
    return encoder(mels.to(p.device, p.dtype))[0].float().cpu()
