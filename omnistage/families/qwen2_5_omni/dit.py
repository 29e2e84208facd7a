"""token2wav's flow-matching solve, with everything that stays fixed during a solve computed once.

transformers' DiT recomputes in each of a solve's passes (10 time points, 9 RK4 steps of 4 passes) the speaker
encoder over the voice's reference mel, the code embeddings, every layer's time conditioning, the attention
masks and the rotary tables. Here the speaker encoder runs once per voice, the time conditioning once per model
(the time grid is fixed), codes, masks and rotary tables once per solve; a pass is only the layers' work on the
noisy state, with query/key/value in one matmul; each query block attends only to the key blocks it can
reach (transformers scores every frame against every frame and masks most scores away), and each seam between
sublayers (gated residual, norm, modulation) is one pass; on CUDA both are Triton kernels (omnistage/kernels).
A float32 DiT's linear layers run on CUDA as 3xTF32 tensor-core products (`exact_gemm`: as exact as strict
float32, and faster than cuBLAS's) unless TF32 is asked for.
Same weights and arithmetic as transformers' `Qwen2_5OmniToken2WavDiTModel` up to float rounding
(tests/families/qwen2_5_omni bound the difference).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.kernels.block_attention import block_attention, block_window_mask, fused_available, kept_window_mask
from omnistage.kernels.exact_gemm import linear
from omnistage.kernels.fused import residual_norm_modulate


def _deinterleaved(dim: int) -> torch.Tensor:
    """(x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...): the layout transformers rotates head 0 in."""
    return torch.cat([torch.arange(0, dim, 2), torch.arange(1, dim, 2)])


class DiTSolver:
    """Solves the DiT's ODE for a batch of windows: `solve(noise, codes, speaker, features)`."""

    def __init__(self, dit: nn.Module, num_steps: int, guidance_scale: float, sway: float | None):
        self.dit, self.guidance_scale = dit, guidance_scale
        cfg = dit.config
        self.width, self.heads, self.mel_dim = cfg.hidden_size, cfg.num_attention_heads, cfg.mel_dim
        self.head_dim = cfg.head_dim
        self.block_size, self.repeats = cfg.block_size, cfg.repeats
        self.reach = [(blk.look_backward_block, blk.look_ahead_block) for blk in dit.transformer_blocks]
        # Layers that look back, and how many frames they reach before a window: what a kept context holds.
        self.back_layers = [i for i, (back, _) in enumerate(self.reach) if back]
        self.kept_frames = max((back for back, _ in self.reach), default=0) * self.block_size
        weight = next(dit.parameters())
        dtype, device = weight.dtype, weight.device
        # The time grid and RK4's evaluation points, as transformers' solver computes them.
        times = torch.linspace(0, 1, num_steps, device=device, dtype=dtype)
        if sway is not None:
            times += sway * (torch.cos(torch.pi / 2 * times) - 1 + times)
        self.steps = [(end - start, (start, start + (end - start) * (1 / 3), start + (end - start) * (2 / 3), end))
                      for start, end in zip(times[:-1], times[1:], strict=True)]
        with torch.no_grad():
            self._fuse_projections()
            self._condition_on_time(torch.stack([t for _, points in self.steps for t in points]))

    def _fuse_projections(self) -> None:
        """One [3 x width, width] matmul per layer for query, key, value; head 0's query and key rows in the
        order transformers rotates them in (their dot products, all attention sees, are unchanged)."""
        order = torch.arange(self.width)
        order[: self.head_dim] = _deinterleaved(self.head_dim)
        self.qkv = []
        for blk in self.dit.transformer_blocks:
            attn = blk.attn
            weight = torch.cat([attn.to_q.weight[order], attn.to_k.weight[order], attn.to_v.weight])
            bias = torch.cat([attn.to_q.bias[order], attn.to_k.bias[order], attn.to_v.bias])
            self.qkv.append((weight, bias))
        proj = self.dit.input_embed.proj
        self.in_state = proj.weight[:, : self.mel_dim]  # the noisy state's columns
        self.in_fixed, self.in_bias = proj.weight[:, self.mel_dim :].contiguous(), proj.bias

    def _condition_on_time(self, points: torch.Tensor) -> None:
        """Every layer's shift/scale/gate at every evaluation point: [points, 6, width] per layer (scales as
        1 + scale), and the output norm's [points, 2, width]."""
        t = self.dit.time_embed(points)
        self.modulation = []
        for blk in self.dit.transformer_blocks:
            mod = blk.attn_norm.linear(F.silu(t)).view(len(points), 6, self.width).clone()
            mod[:, [1, 4]] += 1
            self.modulation.append(mod)
        final = self.dit.norm_out.linear(F.silu(t)).view(len(points), 2, self.width).clone()
        final[:, 0] += 1
        self.final = final

    @torch.no_grad()
    def speaker_features(self, ref_mel: torch.Tensor) -> torch.Tensor:
        """The speaker encoder over a voice's reference mel and over the silent one guidance compares with:
        [1, 2, enc_dim]. Computed once per voice."""
        encoder = self.dit.input_embed.spk_encoder
        return torch.stack([encoder(ref_mel), encoder(torch.zeros_like(ref_mel))], dim=1)

    def kept_shape(self) -> tuple[int, ...]:
        """One window's kept context (`solve`'s `kept` and second output, batch dim first): key and value of
        its last `kept_frames` frames in each look-back layer at each evaluation point, guided and unguided."""
        points = len(self.steps) * 4
        return 2, points, len(self.back_layers), self.kept_frames, 2, self.heads, self.head_dim

    def solve(self, noise: torch.Tensor, codes: torch.Tensor, speaker: torch.Tensor, features: torch.Tensor,
              lengths: torch.Tensor | None = None, kept: torch.Tensor | None = None,
              has_kept: torch.Tensor | None = None, keep: torch.Tensor | None = None
              ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """noise [B, frames, mel], codes [B, frames / repeats], speaker (the voice's `cond`) [B, enc_emb],
        features (speaker_features) [B, 2, enc_dim] -> mel [B, mel, frames]. `lengths` [B]: real frames per
        window, the rest padding (windows of different lengths in one solve, or one graph's shape): attention
        never reads padding and everything else is per frame, so real frames come out as if solved alone.

        A window continuing an earlier one: `kept` [B, *kept_shape()] is what the earlier solve returned for
        the frames just before this window (`has_kept` [B]: 0 where a window has none, e.g. a first one), so
        look-back layers reach into them without solving them again; `keep` [B]: where this window's kept
        frames end (the rest is look-ahead context). Then returns (mel, kept for the next window). The kept
        keys and values are those the earlier window's own solve computed (in a DiT without look-ahead,
        windows solved this way equal one solve of the whole). No host syncs: capturable."""
        batch, frames, _ = noise.shape
        fixed = self._fixed_inputs(codes, speaker, features, frames)
        before = self.kept_frames if kept is not None else 0  # kept frames sit at positions -before..-1
        cos, sin = self.dit.rotary_embed(noise, torch.arange(-before, frames, device=noise.device)[None])
        cos, sin = cos.view(-1, self.head_dim), sin.view(-1, self.head_dim)
        rotary = cos[before:], sin[before:], 1  # head 0 only (as trained)
        if lengths is not None:
            lengths = torch.cat([lengths, lengths])  # the guided rows, then the unguided ones
        probe = noise.new_empty(0, 0, 3, self.heads, self.head_dim)  # the layout block_attention will get
        torch_path = not fused_available(probe)  # which alone reads masks
        masks = self._masks(frames, noise.device, lengths) if torch_path else {}
        seam = None if kept is None else _Seam(self, kept, has_kept, keep, frames, (cos, sin, 1))
        if seam is not None and torch_path:  # masks over [kept; window]
            for reach in {self.reach[i] for i in self.back_layers}:
                masks[("kept", *reach)] = kept_window_mask(frames, self.block_size, *reach, noise.device, lengths,
                                                           self.kept_frames, seam.lengths)
        points = iter(range(len(self.steps) * 4))

        def velocity(state: torch.Tensor) -> torch.Tensor:
            out = self._forward(state, fixed, next(points), rotary, masks, lengths, seam)
            guided, null = out.chunk(2)
            return guided + (guided - null) * self.guidance_scale

        state = noise
        for dt, _ in self.steps:
            k1 = velocity(state)
            k2 = velocity(state + dt * k1 * (1 / 3))
            k3 = velocity(state + dt * (k2 - k1 * (1 / 3)))
            k4 = velocity(state + dt * (k1 - k2 + k3))
            state = state + (k1 + 3 * (k2 + k3) + k4) * dt / 8
        mel = state.permute(0, 2, 1)
        return mel if seam is None else (mel, seam.handed_on())

    def _fixed_inputs(self, codes: torch.Tensor, speaker: torch.Tensor, features: torch.Tensor, frames: int
                      ) -> torch.Tensor:
        """The input projection's part that does not depend on the state, for the guided rows then the
        unguided ones (no speaker, silent reference, dropped codes): [2B x frames, width]."""
        embed = self.dit.text_embed
        code_rows = torch.cat([embed(codes), embed(codes, drop_code=True)])
        feature_rows = torch.cat([features[:, 0], features[:, 1]])
        speaker_rows = torch.cat([speaker, torch.zeros_like(speaker)])
        rows = torch.cat([feature_rows[:, None].expand(-1, frames, -1), code_rows,
                          speaker_rows[:, None].expand(-1, frames, -1)], dim=-1)
        return F.linear(rows, self.in_fixed, self.in_bias).flatten(0, 1)

    def _masks(self, frames: int, device: torch.device, lengths: torch.Tensor | None
               ) -> dict[tuple[int, int], torch.Tensor | None]:
        """Per reach, which keys of each query block's window are real frames (only the torch path of
        block_attention reads them)."""
        return {reach: block_window_mask(frames, self.block_size, *reach, device, lengths)
                for reach in set(self.reach)}

    def _forward(self, state: torch.Tensor, fixed: torch.Tensor, point: int,
                 rotary: tuple[torch.Tensor, torch.Tensor, int], masks: dict[tuple, torch.Tensor | None],
                 lengths: torch.Tensor | None = None, seam: _Seam | None = None) -> torch.Tensor:
        """One DiT pass over [guided; unguided] copies of the state at evaluation point `point`. Each seam
        between sublayers (gated residual, then the next norm and its modulation) is one fused pass."""
        batch, frames, _ = state.shape
        rows, width, heads, head_dim = 2 * batch * frames, self.width, self.heads, self.head_dim
        h = torch.addmm(fixed, torch.cat([state, state]).flatten(0, 1), self.in_state.t())
        blocks = self.dit.transformer_blocks
        mods = [mod[point] for mod in self.modulation]
        h, x = residual_norm_modulate(h, None, None, mods[0][0], mods[0][1], 1e-6)
        for i, (blk, (w_qkv, b_qkv), reach) in enumerate(zip(blocks, self.qkv, self.reach, strict=True)):
            _, _, gate_a, shift_f, scale_f, gate_f = mods[i]
            qkv = linear(x, w_qkv, b_qkv).view(2 * batch, frames, 3, heads, head_dim)
            left = left_lengths = None
            if seam is not None and reach[0]:
                left, left_lengths = seam.exchange(qkv, point, i)
            mask = masks.get(reach if left is None else ("kept", *reach))
            attn = block_attention(qkv, self.block_size, *reach, mask, lengths,
                                   rotary if left is None else seam.rotary, left, left_lengths)
            attn = linear(attn.reshape(rows, width), blk.attn.to_out[0].weight, blk.attn.to_out[0].bias)
            h, x = residual_norm_modulate(h, attn, gate_a, shift_f, scale_f, 1e-6)
            up, down = blk.ff.ff[0], blk.ff.ff[3]
            ff = linear(linear(x, up.weight, up.bias, gelu=True), down.weight, down.bias)
            scale, shift = self.final[point] if i + 1 == len(blocks) else (mods[i + 1][1], mods[i + 1][0])
            h, x = residual_norm_modulate(h, ff, gate_f, shift, scale, 1e-6)
        return linear(x, self.dit.proj_out.weight, self.dit.proj_out.bias).view(2 * batch, frames, self.mel_dim)


class _Seam:
    """Where one window meets the next inside a solve: the kept keys and values look-back layers read, and
    the ones this window keeps for the next, per evaluation point and look-back layer."""

    def __init__(self, solver: DiTSolver, kept: torch.Tensor, has_kept: torch.Tensor, keep: torch.Tensor,
                 frames: int, rotary: tuple[torch.Tensor, torch.Tensor, int]):
        self.rotary = rotary  # tables from the first kept frame's position on
        self.layer = {layer: n for n, layer in enumerate(solver.back_layers)}
        batch, n = kept.shape[0], solver.kept_frames
        # [B, 2, points, layers, ...] -> [points, layers, 2B, ...]: each pass's rows as its qkv orders them
        self.kept = kept.permute(2, 3, 1, 0, *range(4, kept.dim())).flatten(2, 3).contiguous()
        self.lengths = (torch.cat([has_kept, has_kept]) > 0).to(torch.int32) * n
        last = torch.cat([keep, keep])[:, None] - n + torch.arange(n, device=keep.device)[None]
        self.rows = torch.arange(2 * batch, device=keep.device)[:, None]
        self.frames = last.clamp(0, frames - 1)  # a window shorter than the kept span is never continued
        self.kept_on = torch.empty_like(self.kept)
        self.batch = batch

    def exchange(self, qkv: torch.Tensor, point: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep this window's last frames' key and value (before attention: the torch path rotates in place),
        return what the earlier window kept for this pass."""
        n = self.layer[layer]
        self.kept_on[point, n] = qkv[self.rows, self.frames, 1:]
        return self.kept[point, n], self.lengths

    def handed_on(self) -> torch.Tensor:
        """What this solve keeps, batch first: [B, *DiTSolver.kept_shape()]."""
        points, layers = self.kept_on.shape[:2]
        on = self.kept_on.view(points, layers, 2, self.batch, *self.kept_on.shape[3:])
        return on.permute(3, 2, 0, 1, *range(4, on.dim())).contiguous()
