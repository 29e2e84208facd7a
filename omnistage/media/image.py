"""Images: encoded bytes -> an RGB PIL image (EXIF orientation applied, transparency over white)."""

from __future__ import annotations

import io
import warnings
from typing import Any

from omnistage.errors import RequestError
from omnistage.media.source import bad_media, over_limit

DEFAULT_MAX_PIXELS = 16 * 2**20  # LimitsConfig.max_image_pixels


def decode_image(data: bytes, part: str = "image", max_pixels: int = DEFAULT_MAX_PIXELS) -> Any:
    """Decode PNG/JPEG/WebP/GIF/... bytes. More than `max_pixels` pixels is a 413 (checked before the pixels are
    decoded, so a small file that expands hugely costs nothing); bytes that are no image are a 400."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))  # reads the header only
            width, height = image.size
            if width * height > max_pixels:
                raise _too_many_pixels(part, width, height, max_pixels)
            image.load()
    except RequestError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):  # Pillow's own check, in open()
        what = f"the image has more pixels than the limit of {max_pixels}"
        raise over_limit(part, what, "max_image_pixels") from None
    except UnidentifiedImageError:
        raise bad_media(part, "could not decode the image: not a known image format") from None
    except (OSError, ValueError, SyntaxError) as exc:
        raise bad_media(part, f"could not decode the image: {exc}") from None
    if width == 0 or height == 0:
        raise bad_media(part, "could not decode the image: it has no pixels")
    image = ImageOps.exif_transpose(image)
    return to_rgb(image)


def _too_many_pixels(part: str, width: int, height: int, limit: int) -> RequestError:
    what = f"the image has {width}x{height} pixels, more than the limit of {limit}"
    return over_limit(part, what, "max_image_pixels")


def to_rgb(image: Any) -> Any:
    from PIL import Image

    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")
