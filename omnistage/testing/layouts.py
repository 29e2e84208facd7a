"""The tiny-checkpoint layouts the factory knows, importable without torch (the CLI lists them in --help)."""

# Tiny checkpoints in diffusers' pipeline layouts: arch -> (module under omnistage.testing, variant). Each module
# has `FACTORY_VERSION` and `make_tiny(out_dir, variant, seed)`.
DIFFUSERS_LAYOUTS: dict[str, tuple[str, str]] = {
    "flux-dev": ("flux", "dev"),
    "flux-schnell": ("flux", "schnell"),
    "qwen-image": ("qwen_image", "t2i"),
    "qwen-image-edit": ("qwen_image", "edit"),
    "qwen-image-edit-plus": ("qwen_image", "edit-plus"),
    "z-image": ("z_image", "base"),
    "z-image-turbo": ("z_image", "turbo"),
    "wan2_2_t2v": ("wan", "t2v"),
    "wan2_2_i2v": ("wan", "i2v"),
    "wan2_2_ti2v": ("wan", "ti2v"),
    "wan2_2": ("wan", "ti2v"),  # the demo's Wan2.2: the one-DiT TI2V-5B layout
    "stable_audio": ("stable_audio", "open-1.0"),
}
