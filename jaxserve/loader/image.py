"""Images in: decode (pillow) and preprocess as transformers' CLIPImageProcessor does, from a checkpoint's
preprocessor_config.json: RGB, resize the shortest edge (bicubic, on uint8 pixels as PIL does it),
center crop, rescale, normalize -> float32 [3, S, S]. Host side, no JAX."""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_IMAGE_PIXELS = 64 * 2**20  # a decoded image larger than this is refused (decompression bombs)


class ImageError(ValueError):
    """An image that cannot be used (bad data, not an image, too large): the request's fault."""

    param = "messages"


@dataclass(frozen=True)
class ImageProcessorConfig:
    shortest_edge: int | None  # None: resize to (height, width)
    size_hw: tuple[int, int] | None
    crop_hw: tuple[int, int] | None  # None: no center crop
    rescale: float | None
    mean: tuple[float, ...] | None
    std: tuple[float, ...] | None
    resample: int = 3  # PIL's BICUBIC
    convert_rgb: bool = True

    @property
    def output_hw(self) -> tuple[int, int]:
        if self.crop_hw:
            return self.crop_hw
        if self.size_hw:
            return self.size_hw
        raise ValueError("the image processor's output size depends on the image (no crop, shortest-edge resize)")


def _hw(v) -> tuple[int, int] | None:
    if v is None:
        return None
    if isinstance(v, int):
        return v, v
    if "height" in v and "width" in v:
        return int(v["height"]), int(v["width"])
    return None


def processor_config(d: dict, image_size: int) -> ImageProcessorConfig:
    """From a preprocessor_config.json dict (transformers' CLIPImageProcessor defaults for what it omits;
    image_size: the tower's input size, the default crop)."""
    size = d.get("size", {"shortest_edge": image_size})
    short = size if isinstance(size, int) else (size.get("shortest_edge") if isinstance(size, dict) else None)
    resize = d.get("do_resize", True)
    crop = _hw(d.get("crop_size", image_size)) if d.get("do_center_crop", True) else None
    normalize = d.get("do_normalize", True)
    return ImageProcessorConfig(
        shortest_edge=int(short) if resize and short else None,
        size_hw=None if (not resize or short) else _hw(size),
        crop_hw=crop,
        rescale=float(d.get("rescale_factor", 1 / 255)) if d.get("do_rescale", True) else None,
        mean=tuple(d.get("image_mean", CLIP_MEAN)) if normalize else None,
        std=tuple(d.get("image_std", CLIP_STD)) if normalize else None,
        resample=int(d.get("resample", 3)), convert_rgb=bool(d.get("do_convert_rgb", True)))


def processor_config_from_dir(model_dir: Path | None, image_size: int) -> ImageProcessorConfig:
    path = Path(model_dir) / "preprocessor_config.json" if model_dir else None
    d = json.loads(path.read_text()) if path and path.is_file() else {}
    return processor_config(d, image_size)


def decode_image(data: bytes):
    """Bytes of an encoded image (PNG, JPEG, ...) -> a loaded PIL image; ImageError when they are not one."""
    from PIL import Image

    try:
        img = Image.open(io.BytesIO(data))
        if img.width * img.height > MAX_IMAGE_PIXELS:
            raise ImageError(f"image of {img.width}x{img.height} pixels is too large "
                             f"(at most {MAX_IMAGE_PIXELS} pixels)")
        img.load()
    except ImageError:
        raise
    except Exception as e:  # PIL raises many kinds (UnidentifiedImageError, OSError, ...)
        raise ImageError(f"not a readable image: {e}") from None
    return img


def decode_data_url(url: str):
    """A data:image/...;base64,... URL -> PIL image (ImageError for anything else)."""
    head, sep, payload = url.partition(",")
    if not sep or not head.startswith("data:") or not head.endswith(";base64"):
        raise ImageError("an image data URL must look like data:image/<type>;base64,<data>")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the image data URL's base64 payload is malformed") from None
    return decode_image(data)


def _center_crop(a: np.ndarray, hw: tuple[int, int]) -> np.ndarray:
    """a [C, H, W]; pads with zeros where the image is smaller (as transformers' center_crop)."""
    C, H, W = a.shape
    th, tw = hw
    if H < th or W < tw:
        ph, pw = max(th, H), max(tw, W)
        out = np.zeros((C, ph, pw), a.dtype)
        top, left = (ph - H) // 2, (pw - W) // 2
        out[:, top:top + H, left:left + W] = a
        a, H, W = out, ph, pw
    top, left = (H - th) // 2, (W - tw) // 2
    return a[:, top:top + th, left:left + tw]


def _rgb(img, pc: ImageProcessorConfig):
    from PIL import Image

    if not isinstance(img, Image.Image):
        raise ImageError(f"an image must be a PIL.Image, got {type(img).__name__}")
    if pc.convert_rgb:  # as transformers: transparency composited onto white
        try:
            if "A" in img.getbands() or img.info.get("transparency") is not None:
                rgba = img.convert("RGBA")
                return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
            return img.convert("RGB")
        except (ValueError, OSError) as e:  # modes PIL cannot convert (e.g. "La"): the request's image
            raise ImageError(f"an image in mode {img.mode} cannot be converted to RGB: {e}") from None
    if img.mode != "RGB":
        raise ImageError(f"a {img.mode} image needs do_convert_rgb in the image processor config")
    return img


def preprocess(img, pc: ImageProcessorConfig) -> np.ndarray:
    """A PIL image -> normalized float32 pixels [C, H, W]."""
    img = _rgb(img, pc)
    if pc.shortest_edge or pc.size_hw:
        w, h = img.size
        if pc.shortest_edge:
            short, long = (w, h) if w <= h else (h, w)
            new_short, new_long = pc.shortest_edge, int(pc.shortest_edge * long / short)
            size = (new_short, new_long) if w <= h else (new_long, new_short)
        else:
            size = pc.size_hw[::-1]
        img = img.resize(size, resample=pc.resample)
    a = np.asarray(img).transpose(2, 0, 1)  # HWC -> CHW
    if pc.crop_hw:
        a = _center_crop(a, pc.crop_hw)
    a = a.astype(np.float32)
    if pc.rescale is not None:
        a = (a.astype(np.float64) * pc.rescale).astype(np.float32)
    if pc.mean is not None:
        mean = np.asarray(pc.mean, np.float32)[:, None, None]
        std = np.asarray(pc.std, np.float32)[:, None, None]
        a = (a - mean) / std
    return np.ascontiguousarray(a, np.float32)


def preprocess_anyres(img, pc: ImageProcessorConfig, pinpoints, tile: int) -> tuple[np.ndarray, tuple[int, int]]:
    """LLaVA-NeXT (transformers' LlavaNextImageProcessor, PIL backend): a PIL image -> (normalized tiles
    [1 + rows*cols, C, tile, tile]: the whole image resized to the processor's square size, then the image
    resized into its best grid resolution (aspect kept, bicubic on uint8 pixels), padded with black around
    it and cut row by row; the image's (height, width))."""
    from PIL import Image

    from jaxserve.models import anyres

    img = _rgb(img, pc)
    hw = (img.height, img.width)
    bh, bw = anyres.best_resolution(hw, pinpoints)
    nh, nw = anyres.resized_within(hw, (bh, bw))
    canvas = np.zeros((bh, bw, 3), np.uint8)
    top, left = (bh - nh) // 2, (bw - nw) // 2
    canvas[top:top + nh, left:left + nw] = np.asarray(img.resize((nw, nh), resample=pc.resample))
    side = (pc.shortest_edge, pc.shortest_edge) if pc.shortest_edge else pc.size_hw
    tiles = [img.resize(side[::-1], resample=pc.resample)]
    tiles += [Image.fromarray(canvas[i:i + tile, j:j + tile]) for i in range(0, bh, tile) for j in range(0, bw, tile)]
    return np.stack([preprocess(t, pc) for t in tiles]), hw


@dataclass(frozen=True)
class QwenImageProcessor:
    """transformers' Qwen2VLImageProcessor settings (preprocessor_config.json): images are resized to multiples
    of patch * merge pixels with their area in [min_pixels, max_pixels]."""

    min_pixels: int
    max_pixels: int
    patch: int
    temporal: int
    merge: int
    rescale: float | None
    mean: tuple[float, ...] | None
    std: tuple[float, ...] | None
    resample: int = 3

    @classmethod
    def from_dict(cls, d: dict, max_patches: int) -> "QwenImageProcessor":
        size = d.get("size") or {}
        lo = d.get("min_pixels") or size.get("shortest_edge") or 56 * 56
        hi = d.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280
        patch = int(d.get("patch_size", 14))
        normalize = d.get("do_normalize", True)
        return cls(min_pixels=int(lo), max_pixels=min(int(hi), max_patches * patch * patch), patch=patch,
                   temporal=int(d.get("temporal_patch_size", 2)), merge=int(d.get("merge_size", 2)),
                   rescale=float(d.get("rescale_factor", 1 / 255)) if d.get("do_rescale", True) else None,
                   mean=tuple(d.get("image_mean", CLIP_MEAN)) if normalize else None,
                   std=tuple(d.get("image_std", CLIP_STD)) if normalize else None,
                   resample=int(d.get("resample", 3)))

    def resized_hw(self, h: int, w: int) -> tuple[int, int]:
        """transformers' smart_resize: the nearest multiples of patch * merge, scaled into the pixel range."""
        import math

        f = self.patch * self.merge
        if min(h, w) < 1:
            raise ImageError(f"an image of {w}x{h} pixels is empty")
        if max(h, w) / min(h, w) > 200:
            raise ImageError(f"an image of {w}x{h} pixels: the aspect ratio must be under 200")
        hb, wb = round(h / f) * f, round(w / f) * f
        if hb * wb < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (h * w))
            hb, wb = math.ceil(h * beta / f) * f, math.ceil(w * beta / f) * f
        # Never above max_pixels (transformers' can be; the vision programs' largest patch bucket is sized by it):
        # checked after the scale-up too (rounded up to a min_pixels near max_pixels), and a long thin image whose
        # short side was raised to one cell gets its long side shortened.
        if hb * wb > self.max_pixels:
            beta = math.sqrt(h * w / self.max_pixels)
            hb, wb = max(f, math.floor(h / beta / f) * f), max(f, math.floor(w / beta / f) * f)
        if hb * wb > self.max_pixels:
            if hb <= wb:
                wb = max(f, self.max_pixels // hb // f * f)
            else:
                hb = max(f, self.max_pixels // wb // f * f)
        return hb, wb


def preprocess_qwen_vl(img, qp: QwenImageProcessor) -> tuple[np.ndarray, tuple[int, int]]:
    """Qwen2-VL (transformers' Qwen2VLImageProcessorPil): a PIL image -> (patches [gh * gw, C * temporal *
    patch * patch] float32 — merge x merge groups of patches row by row, each patch repeated over the
    temporal frames —, the patch grid (gh, gw))."""
    pc = ImageProcessorConfig(None, None, None, qp.rescale, qp.mean, qp.std, qp.resample)
    img = _rgb(img, pc)
    hb, wb = qp.resized_hw(img.height, img.width)
    a = preprocess(img.resize((wb, hb), resample=qp.resample), pc)  # [C, hb, wb]
    C, p, m = a.shape[0], qp.patch, qp.merge
    gh, gw = hb // p, wb // p
    a = a.reshape(C, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)  # (gh/m, gw/m, m, m, C, p, p)
    a = np.broadcast_to(a[:, :, :, :, :, None], (*a.shape[:5], qp.temporal, p, p))
    return np.ascontiguousarray(a.reshape(gh * gw, C * qp.temporal * p * p), np.float32), (gh, gw)


def content_hash(pixels: np.ndarray, extra: bytes = b"") -> bytes:
    """What the prefix cache keys an image's placeholder blocks on: the preprocessed pixels (and, for
    LLaVA-NeXT, the image's size, which decides the rows its features keep)."""
    return hashlib.blake2b(pixels.tobytes() + extra, digest_size=16).digest()


def split_content(parts: list[dict], where: str = "content") -> tuple[list[dict], list]:
    """A message's content parts (OpenAI's {"type": "image_url", "image_url": {"url": ...}}, vLLM's
    {"type": "image_pil", "image_pil": PIL.Image}, or {"type": "image", "image": ...}) -> (the parts a
    chat template sees: text parts and {"type": "image"}, the image sources in order: URL strings or
    PIL images)."""
    out, sources = [], []
    for j, p in enumerate(parts):
        kind = p.get("type")
        if kind == "text":
            out.append({"type": "text", "text": p.get("text") or ""})
            continue
        if kind == "image_url":
            ref = p.get("image_url")
            src = ref.get("url") if isinstance(ref, dict) else ref
        elif kind in ("image", "image_pil"):
            src = p.get(kind)
        else:
            raise ImageError(f"{where}[{j}]: content parts of type {kind!r} are not supported (text and images)")
        if src is None or (isinstance(src, str) and not src):
            raise ImageError(f"{where}[{j}]: an {kind} part needs an image")
        out.append({"type": "image"})
        sources.append(src)
    return out, sources


def load_source(src):
    """An image source of split_content without the network: a PIL image or a data URL."""
    from PIL import Image

    if isinstance(src, Image.Image):
        return src
    if isinstance(src, str) and src.startswith("data:"):
        return decode_data_url(src)
    raise ImageError(f"an image must be a PIL image or a data: URL here, got {str(src)[:40]!r}")
