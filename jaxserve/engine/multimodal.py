"""Image inputs of a prompt, host side (no JAX).

A multimodal prompt is its token ids with each image's placeholder token expanded to one token per
projected feature row, plus, per image, where its run starts, the preprocessed pixels and a content
hash. The runner encodes an image when a step first needs its rows (models/clip_vision.py) and the
step's embeddings of those positions are replaced by the features; the features are shared by the
request's n choices and dropped once all of them are past the images (a recompute after preemption
encodes an image again).
The prefix cache keys the blocks of a placeholder run on the image's hash (block_extra), so two
images never share blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


class MultiModalError(ValueError):
    """A prompt whose images and placeholders do not fit together: the request's fault."""

    param = "prompt"


@dataclass(frozen=True)
class ImageInput:
    offset: int  # position of the first placeholder token in the prompt
    length: int  # placeholder tokens = feature rows
    pixels: np.ndarray  # preprocessed [C, H, W] float32 (LLaVA-NeXT: its tiles [N, C, H, W])
    hash: bytes
    size_hw: tuple[int, int] | None = None  # LLaVA-NeXT: the image's size (its tiles' features are packed by it)
    # Qwen2-VL: the image's token grid (rows, columns): its placeholder run is that grid row by row, and
    # its multimodal RoPE positions come from it (rope_deltas)
    grid: tuple[int, int] | None = None


@dataclass
class MultiModalPrompt:
    token_ids: list[int]
    images: list[ImageInput] = field(default_factory=list)
    text: str | None = None
    # image index -> projected features (host array), filled by the runner when a step first needs them
    # and dropped by the engine once every sequence of the request is past the images
    features: dict = field(default_factory=dict)
    # Gemma 3: an image's rows attend to each other both ways, so a prefill chunk never ends inside a run
    # (`chunk_end`) and the runner gives each image row its run's last position as its attention limit
    bidirectional: bool = False

    @property
    def end(self) -> int:
        """The position after the last image's run: prefill past it no longer needs any feature."""
        return max((im.offset + im.length for im in self.images), default=0)


def expand_placeholders(ids: list[int], prepared: list[tuple], image_token_id: int,
                        text: str | None = None) -> MultiModalPrompt:
    """Each lone image placeholder in ids becomes as many of them as its image has feature rows, one image
    per placeholder in order. prepared: per image (pixels, feature rows, content hash, size or None[, token
    grid (Qwen2-VL)])."""
    where = [i for i, t in enumerate(ids) if t == image_token_id]
    if len(where) != len(prepared):
        raise MultiModalError(f"the prompt has {len(where)} image placeholder token(s) (id {image_token_id}) "
                              f"for {len(prepared)} image(s): one placeholder per image")
    out: list[int] = []
    images = []
    prev = 0
    for i, (px, n, h, hw, *grid) in zip(where, prepared):
        out += ids[prev:i]
        images.append(ImageInput(len(out), n, px, h, hw, *grid))
        out += [image_token_id] * n
        prev = i + 1
    out += ids[prev:]
    return MultiModalPrompt(out, images, text)


def expand_gemma3(prompt: str | list[int], prepared: list[tuple], special: dict, num_rows: int,
                  encode, newline_ids: list[int]) -> MultiModalPrompt:
    """Gemma 3's prompts: each begin-of-image token (the chat template's image placeholder) becomes
    "\n\n" boi, num_rows image tokens, eoi "\n\n", as transformers' Gemma3Processor replaces it in the
    text before tokenizing (a str prompt: the replaced text is tokenized, exactly as there; token ids: the
    pieces are inserted by id). prepared: as for expand_placeholders; special: {"boi", "eoi", "image"} ->
    (text, id); encode: a prompt's text -> ids; newline_ids: "\n\n" tokenized alone."""
    (boi, boi_id), (eoi, eoi_id), (img, img_id) = special["boi"], special["eoi"], special["image"]
    n = prompt.count(boi) if isinstance(prompt, str) else prompt.count(boi_id)
    if n != len(prepared):
        raise MultiModalError(f"the prompt has {n} image placeholder(s) ({boi!r}) for {len(prepared)} image(s): "
                              "one placeholder per image")
    if isinstance(prompt, str):
        ids = encode(prompt.replace(boi, f"\n\n{boi}{img * num_rows}{eoi}\n\n"))
    else:
        nl, ids = list(newline_ids), []
        for t in prompt:
            ids += nl + [boi_id] + [img_id] * num_rows + [eoi_id] + nl if t == boi_id else [t]
    starts = [i for i, t in enumerate(ids) if t == img_id and (i == 0 or ids[i - 1] != img_id)]
    if len(starts) != n or ids.count(img_id) != n * num_rows:
        raise MultiModalError(f"the prompt holds image tokens ({img!r}) of its own: {ids.count(img_id)} where its "
                              f"{n} image(s) take {n * num_rows}")
    images = [ImageInput(i, num_rows, px, h, hw) for i, (px, _, h, hw) in zip(starts, prepared)]
    return MultiModalPrompt(ids, images, prompt if isinstance(prompt, str) else None, bidirectional=True)


def chunk_end(mm: MultiModalPrompt | None, start: int, end: int) -> int:
    """Where a prefill chunk [start, end) may end: before an image run it would cut, for models whose image
    rows attend both ways (a run must be computed in one step: its first rows read its last ones), or at the
    run's end when the chunk starts inside it."""
    if mm is None or not mm.bidirectional:
        return end
    for im in mm.images:
        lo, hi = im.offset, im.offset + im.length
        if lo < end < hi:
            return lo if lo > start else hi
    return end


def at_run(mm: MultiModalPrompt | None, pos: int) -> bool:
    """Whether a prefill chunk starting at pos must hold an image run to its end (chunk_end)."""
    return mm is not None and mm.bidirectional and chunk_end(mm, pos, pos + 1) > pos + 1


def rope_deltas(mm: MultiModalPrompt | None, start: int, n: int) -> np.ndarray:
    """Multimodal RoPE (Qwen2-VL, transformers' get_rope_index): for positions [start, start + n), each
    token's (temporal, height, width) rotary position minus its position, [3, n] int32. An image's run
    starting at offset o (text before it offset by d) takes (o + d, o + d + row, o + d + column) of its
    token grid; the text after it continues from o + d + max(rows, columns), so its offset grows by
    max(rows, columns) - run length. Text-only prompts: zeros (plain RoPE)."""
    out = np.zeros((3, n), np.int64)
    if mm is None:
        return out.astype(np.int32)
    pos = np.arange(start, start + n)
    d = 0
    for im in mm.images:  # in prompt order: each image sets its run and everything after it
        if im.grid is None:
            continue
        rows, cols = im.grid
        lo, hi = im.offset, im.offset + im.length
        inside = (pos >= lo) & (pos < hi)
        k = pos[inside] - lo
        first = lo + d
        out[0, inside] = first - pos[inside]
        out[1, inside] = first + k // cols - pos[inside]
        out[2, inside] = first + k % cols - pos[inside]
        d += max(rows, cols) - im.length
        out[:, pos >= hi] = d
    return out.astype(np.int32)


def block_extra(mm: MultiModalPrompt | None, lo: int, hi: int) -> bytes:
    """The hashes of the images whose placeholder runs overlap positions [lo, hi): mixed into that
    block's prefix-cache hash."""
    if mm is None:
        return b""
    return b"".join(im.hash for im in mm.images if im.offset < hi and lo < im.offset + im.length)


def overrides(mm: MultiModalPrompt, start: int, n: int):
    """For the positions [start, start + n) of a step: (image index, first feature row, first position
    relative to start, rows) of every image run they overlap."""
    out = []
    for j, im in enumerate(mm.images):
        lo, hi = max(start, im.offset), min(start + n, im.offset + im.length)
        if lo < hi:
            out.append((j, lo - im.offset, lo - start, hi - lo))
    return out
