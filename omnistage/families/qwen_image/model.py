"""Qwen-Image's parts as the diffusion engine drives them: the Qwen2.5-VL text encoder (its last hidden states, the
prompt template's system prefix dropped), the MMDiT (`QwenImageTransformer2DModel`) and the video-style VAE
(`AutoencoderKLQwenImage`, one frame), loaded from diffusers' `QwenImagePipeline` / `QwenImageEditPipeline` /
`QwenImageEditPlusPipeline` directory layouts.

Each part computes what the diffusers pipeline computes for the same inputs:
- text: the prompt in the variant's template, the hidden states of its valid tokens from `DROP[variant]` on (t2i:
  at most `max_sequence_length` of them); edit models see the input images through the processor (Edit: the image
  resized to ~1024x1024 pixels; Edit-Plus: each image at ~384x384, announced as "Picture k:" before the prompt).
- edit conditioning: each input image resized to ~1024x1024 pixels, VAE-encoded (posterior mode), normalized by the
  VAE's latents mean / std and 2x2-packed; its tokens follow the noise tokens in the DiT's sequence (RoPE frame k+1)
  and their outputs are dropped.
- true CFG: neg + s * (pos - neg), rescaled per token to the norm of the positive prediction.
- decode: latents * std + mean, the VAE's first frame, [-1, 1] -> [0, 1].

Batch invariance: text embeddings of a batch are zero-padded to one length with a mask (`collate`), which the DiT
applies as an attention mask; rows whose conditioning images differ in latent size cannot share one RoPE table, so
`velocity` runs one DiT forward per group of equal conditioning shapes (the batch key only sees the params).
"""

from __future__ import annotations

import json
import math
from collections.abc import Hashable
from pathlib import Path

import torch

from omnistage.engine.diffusion.params import DiffusionParams
from omnistage.engine.schedulers.flow_match import FlowMatch, FlowMatchConfig, Schedule
from omnistage.families.base import TRANSFORMERS_LOAD
from omnistage.families.diffusion import component_config

VARIANTS = {"QwenImagePipeline": "t2i", "QwenImageEditPipeline": "edit", "QwenImageEditPlusPipeline": "edit-plus"}
_SYSTEM_T2I = ("Describe the image by detailing the color, shape, size, texture, quantity, text, spatial "
               "relationships of the objects and background:")
_SYSTEM_EDIT = ("Describe the key features of the input image (color, shape, size, texture, objects, background), "
                "then explain how the user's text instruction should alter or modify the image. Generate a new image "
                "that meets the user's requirements while maintaining consistency with the original input where "
                "appropriate.")
_VISION = "<|vision_start|><|image_pad|><|vision_end|>"


def _template(system: str, user: str) -> str:
    return f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


# The prompt template per variant ({} is the prompt) and how many leading tokens (the system prefix) are dropped.
TEMPLATES = {"t2i": _template(_SYSTEM_T2I, "{}"), "edit": _template(_SYSTEM_EDIT, _VISION + "{}"),
             "edit-plus": _template(_SYSTEM_EDIT, "{}")}
DROP = {"t2i": 34, "edit": 64, "edit-plus": 64}
MAX_SEQUENCE_LENGTH = 1024  # the text encoder's limit in Qwen-Image
VAE_AREA = 1024 * 1024  # pixels of an edit model's conditioning image (and of its default output)
CONDITION_AREA = 384 * 384  # pixels of each image Edit-Plus shows the text encoder

QwenKey = tuple[int, int]  # (latent height, latent width) of the output


def fit_area(area: int, width: int, height: int) -> tuple[int, int]:
    """(width, height) of about `area` pixels with the aspect ratio of width x height, each a multiple of 32."""
    ratio = width / height
    w = math.sqrt(area * ratio)
    return round(w / 32) * 32, round(w / ratio / 32) * 32


def _pad_cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Row blocks zero-padded along dim 1 (sequence) to the longest, then stacked."""
    if tensors[0].ndim < 2:
        return torch.cat(tensors)
    length = max(t.shape[1] for t in tensors)
    return torch.cat([torch.nn.functional.pad(t, (0, 0) * (t.ndim - 2) + (0, length - t.shape[1])) for t in tensors])


class QwenImageModel:
    def __init__(self, path: Path, device: torch.device, dtype: torch.dtype, parts: str = "all"):
        """`parts` (families.diffusion.Parts): "encoders" loads the tokenizer / processor and text encoder (and the
        VAE, whose encoder makes an edit's image latents), "dit" the DiT and VAE only, "all" everything."""
        from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
        from diffusers.image_processor import VaeImageProcessor
        from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

        self.device, self.dtype = device, dtype
        self.variant = VARIANTS[json.loads((path / "model_index.json").read_text())["_class_name"]]
        if parts != "dit":
            self.tokenizer = Qwen2Tokenizer.from_pretrained(path / "tokenizer")
            self.processor = None
            if self.variant != "t2i":
                from transformers import Qwen2VLProcessor

                self.processor = Qwen2VLProcessor.from_pretrained(path / "processor")
            self.text_encoder = Qwen2_5_VLForConditionalGeneration.from_pretrained(
                path / "text_encoder", dtype=dtype, **TRANSFORMERS_LOAD).to(device).eval()
        if parts != "encoders":
            self.transformer = QwenImageTransformer2DModel.from_pretrained(
                path / "transformer", torch_dtype=dtype).to(device).eval()
        if parts != "encoders" or self.variant != "t2i":
            self.vae = AutoencoderKLQwenImage.from_pretrained(path / "vae", torch_dtype=dtype).to(device).eval()
        self.scheduler = FlowMatch(FlowMatchConfig.from_diffusers(
            json.loads((path / "scheduler" / "scheduler_config.json").read_text())))
        vae = component_config(AutoencoderKLQwenImage, path / "vae")
        self.vae_scale_factor = 2 ** len(vae["temperal_downsample"])
        transformer = component_config(QwenImageTransformer2DModel, path / "transformer")
        self.latent_channels = transformer["in_channels"] // 4  # packed as 2x2 patches
        self.image_processor = VaeImageProcessor(vae_scale_factor=self.vae_scale_factor * 2)
        # Per-channel latent statistics, moved to where the latents are (weights may be offloaded to the CPU).
        stats = (vae["latents_mean"], vae["latents_std"])
        self._mean, self._std = (torch.tensor(s).view(1, -1, 1, 1, 1).to(dtype) for s in stats)

    # ---- shapes and schedule ----------------------------------------------------------------

    def batch_key(self, params: DiffusionParams) -> QwenKey:
        return (2 * (params.height // (self.vae_scale_factor * 2)), 2 * (params.width // (self.vae_scale_factor * 2)))

    def noise_shape(self, params: DiffusionParams) -> tuple[int, ...]:
        h, w = self.batch_key(params)
        return (1, self.latent_channels, h, w)  # one video frame

    def schedule(self, params: DiffusionParams) -> Schedule:
        h, w = self.batch_key(params)
        return self.scheduler.schedule(params.num_inference_steps, image_seq_len=(h // 2) * (w // 2))

    def cfg_scale(self, params: DiffusionParams) -> float | None:
        # diffusers' true CFG: only with a negative prompt and a scale above 1.
        return params.true_cfg_scale if params.true_cfg_scale > 1 and params.negative_prompt is not None else None

    @staticmethod
    def _pack(latents: torch.Tensor) -> torch.Tensor:
        """[n, C, h, w] with a frame axis of 1 anywhere before h -> [n, (h/2)(w/2), 4C]: each 2x2 patch of the latent
        grid is one token."""
        n, h, w = latents.shape[0], *latents.shape[-2:]
        c = latents.numel() // (n * h * w)
        patches = latents.reshape(n, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
        return patches.reshape(n, (h // 2) * (w // 2), c * 4)

    def pack(self, noise: torch.Tensor, key: Hashable) -> torch.Tensor:
        return self._pack(noise)

    def unpack(self, latents: torch.Tensor, key: QwenKey) -> torch.Tensor:
        h, w = key
        n, _, d = latents.shape
        grid = latents.view(n, h // 2, w // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
        return grid.reshape(n, d // 4, 1, h, w)

    # ---- conditioning -----------------------------------------------------------------------

    def _images(self, inputs: dict[str, torch.Tensor]) -> list:
        from PIL import Image

        keys = sorted((k for k in inputs if k.startswith("image_")), key=lambda k: int(k.split("_")[1]))
        return [Image.fromarray(inputs[k].numpy()) for k in keys]

    def _condition(self, images: list) -> tuple[list, torch.Tensor, torch.Tensor]:
        """A request's images -> (the images the text encoder sees, packed VAE latents [1, S, 4C], their token grids
        [k, 3] as (frames, rows, columns))."""
        shown, latents, shapes = [], [], []
        for image in images:
            vae_w, vae_h = fit_area(VAE_AREA, *image.size)
            if self.variant == "edit":  # resized once, for both encoders
                image = self.image_processor.resize(image, vae_h, vae_w)
                shown.append(image)
            else:
                shown.append(self.image_processor.resize(image, *reversed(fit_area(CONDITION_AREA, *image.size))))
            pixels = self.image_processor.preprocess(image, vae_h, vae_w).unsqueeze(2)
            z = self.vae.encode(pixels.to(self.device, self.dtype)).latent_dist.mode()
            latents.append(self._pack((z - self._mean.to(z.device)) / self._std.to(z.device)))
            shapes.append((1, z.shape[-2] // 2, z.shape[-1] // 2))
        return shown, torch.cat(latents, dim=1), torch.tensor(shapes, dtype=torch.int64)

    def encode(self, prompts: list[str], params: list[DiffusionParams], inputs: list[dict[str, torch.Tensor]]
               ) -> dict[str, torch.Tensor]:
        """Per prompt: the text embeddings padded to the batch's longest with their mask; for edit models also the
        packed conditioning latents and their grids (both zero-padded)."""
        template, cond = TEMPLATES[self.variant], {}
        if self.variant == "t2i":
            tokens = self.tokenizer([template.format(p) for p in prompts], max_length=MAX_SEQUENCE_LENGTH + DROP["t2i"],
                                    padding=True, truncation=True, return_tensors="pt")
            limits = [p.max_sequence_length for p in params]
        else:
            conditions: dict[int, tuple] = {}  # a request's branches share its inputs: encode its images once
            for inp in inputs:
                if id(inp) not in conditions:
                    conditions[id(inp)] = self._condition(self._images(inp))
            texts, shown = [], []
            for prompt, inp in zip(prompts, inputs, strict=True):
                images = conditions[id(inp)][0]
                pictures = "".join(f"Picture {i + 1}: {_VISION}" for i in range(len(images)))
                texts.append(template.format(prompt if self.variant == "edit" else pictures + prompt))
                shown += images
            tokens = self.processor(text=texts, images=shown, padding=True, return_tensors="pt")
            limits = [None] * len(prompts)
            cond["image_latents"] = _pad_cat([conditions[id(inp)][1] for inp in inputs])
            cond["image_shapes"] = _pad_cat([conditions[id(inp)][2][None] for inp in inputs])
        tokens = tokens.to(self.device)
        hidden = self.text_encoder(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"],
                                   pixel_values=tokens.get("pixel_values"), image_grid_thw=tokens.get("image_grid_thw"),
                                   output_hidden_states=True).hidden_states[-1]
        mask = tokens["attention_mask"].bool()
        rows = [hidden[i][mask[i]][DROP[self.variant]:][:limits[i]] for i in range(len(prompts))]
        cond["prompt_embeds"] = _pad_cat([r[None] for r in rows]).to(self.dtype)
        cond["prompt_mask"] = _pad_cat([torch.ones(1, len(r), dtype=torch.bool, device=self.device) for r in rows])
        return cond

    def collate(self, conds: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return {k: _pad_cat([c[k] for c in conds]) for k in conds[0]}

    # ---- the loop -----------------------------------------------------------------------------

    def velocity(self, latents: torch.Tensor, timesteps: torch.Tensor, cond: dict[str, torch.Tensor],
                 key: QwenKey) -> torch.Tensor:
        h, w = key
        output = (1, h // 2, w // 2)
        groups: dict[tuple, list[int]] = {}
        shapes = cond.get("image_shapes")
        for row in range(len(latents)):
            grids = () if shapes is None else tuple(tuple(s) for s in shapes[row].tolist() if s[0])
            groups.setdefault(grids, []).append(row)
        timesteps = timesteps.to(latents.dtype) / 1000  # the DiT is conditioned on sigma
        out = torch.empty_like(latents)
        for grids, rows in groups.items():
            index = torch.tensor(rows, device=latents.device)
            hidden = latents[index]
            if grids:
                hidden = torch.cat([hidden, cond["image_latents"][index, :sum(f * r * c for f, r, c in grids)]], dim=1)
            mask = cond["prompt_mask"][index]
            length = int(mask.sum(1).max())  # the group's own padding only
            mask = mask[:, :length]
            out[index] = self.transformer(
                hidden_states=hidden,
                timestep=timesteps[index],
                encoder_hidden_states=cond["prompt_embeds"][index, :length],
                encoder_hidden_states_mask=None if mask.all() else mask,
                img_shapes=[[output, *grids]] * len(rows),
                return_dict=False,
            )[0][:, :latents.shape[1]]
        return out

    @staticmethod
    def combine(pos: torch.Tensor, neg: torch.Tensor, scale: float) -> torch.Tensor:
        """True CFG with diffusers' rescale: the mix keeps each token's velocity norm of the positive branch."""
        mixed = neg + scale * (pos - neg)
        return mixed * (torch.norm(pos, dim=-1, keepdim=True) / torch.norm(mixed, dim=-1, keepdim=True))

    def prompt_tokens(self, params: DiffusionParams, cond: dict[str, torch.Tensor]) -> int:
        """The text-encoder tokens the DiT attends to for the prompt (`prompt_mask`'s real tokens)."""
        return int(cond["prompt_mask"].sum())

    def decode(self, latents: torch.Tensor, key: QwenKey) -> torch.Tensor:
        z = self.unpack(latents, key).to(self.vae.dtype)
        z = z / (1.0 / self._std.to(z.device)) + self._mean.to(z.device)  # as diffusers rounds it
        image = self.vae.decode(z, return_dict=False)[0][:, :, 0]
        return (image / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).float().cpu()
