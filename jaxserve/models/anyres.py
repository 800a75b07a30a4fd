"""LLaVA-NeXT's "any resolution" images, host side (numpy, no JAX): which grid of tower-sized tiles an
image is cut into, how many placeholder tokens its features take, and how the tiles' projected features
are laid out for the language model (transformers' LlavaNextForConditionalGeneration.pack_image_features).

An image of (h, w) pixels is resized (aspect kept) into the best of `image_grid_pinpoints`, padded to it and
cut into (rows x cols) tiles of the tower's size S; the whole image resized to S x S comes first. Each tile
goes through the CLIP tower and projector (models/clip_vision.py) to g x g feature rows (g = S / patch).
The language model then reads the base tile's g*g rows, followed by the grid's features as one
(rows*g) x (cols*g) map with the padding rows or columns removed (`unpadded`) and the `image_newline`
vector after each of its rows.
"""

from __future__ import annotations

import numpy as np


def best_resolution(hw: tuple[int, int], pinpoints) -> tuple[int, int]:
    """The (height, width) of pinpoints that keeps most of the image's pixels, then wastes the fewest."""
    h, w = hw
    best, most, least = None, 0, float("inf")
    for ph, pw in pinpoints:
        scale = min(pw / w, ph / h)
        kept = min(int(w * scale) * int(h * scale), w * h)
        wasted = pw * ph - kept
        if kept > most or (kept == most and wasted < least):
            best, most, least = (ph, pw), kept, wasted
    return best


def resized_within(hw: tuple[int, int], target: tuple[int, int]) -> tuple[int, int]:
    """The (height, width) an image of hw takes inside target with its aspect kept (before the padding)."""
    h, w = hw
    th, tw = target
    sw, sh = tw / w, th / h
    if sw < sh:
        return min(int(np.ceil(h * sw)), th), tw
    return th, min(int(np.ceil(w * sh)), tw)


def grid_shape(hw: tuple[int, int], pinpoints, tile: int) -> tuple[int, int]:
    """(rows, cols) of tiles an image of hw is cut into."""
    bh, bw = best_resolution(hw, pinpoints)
    return bh // tile, bw // tile


def unpadded(hw: tuple[int, int], map_hw: tuple[int, int]) -> tuple[int, int, int, int]:
    """(top, bottom, left, right) of the feature map of map_hw that covers the image (not its padding)."""
    h, w = hw
    ch, cw = map_hw
    if w / h > cw / ch:
        new_h = int(round(h * (cw / w), 7))
        pad = (ch - new_h) // 2
        return pad, ch - pad, 0, cw
    new_w = int(round(w * (ch / h), 7))
    pad = (cw - new_w) // 2
    return 0, ch, pad, cw - pad


def num_features(hw: tuple[int, int], pinpoints, tile: int, patch: int) -> int:
    """Placeholder tokens of an image of hw: the base tile's rows, the unpadded grid map and one newline per
    map row (the "default" strategy: no CLS rows)."""
    g = tile // patch
    rows, cols = grid_shape(hw, pinpoints, tile)
    top, bottom, left, right = unpadded(hw, (rows * g, cols * g))
    return g * g + (bottom - top) * (right - left + 1)


def pack(feats: np.ndarray, hw: tuple[int, int], pinpoints, tile: int, patch: int, newline: np.ndarray) -> np.ndarray:
    """feats [1 + rows*cols, g*g, D] (base tile first, then the grid row by row) -> [num_features, D]."""
    g = tile // patch
    rows, cols = grid_shape(hw, pinpoints, tile)
    n, _, D = feats.shape
    if n != 1 + rows * cols:
        raise ValueError(f"{n} tiles for a {rows}x{cols} grid")
    grid = feats[1:].reshape(rows, cols, g, g, D).transpose(0, 2, 1, 3, 4).reshape(rows * g, cols * g, D)
    top, bottom, left, right = unpadded(hw, grid.shape[:2])
    grid = grid[top:bottom, left:right]
    nl = np.broadcast_to(newline.astype(grid.dtype), (grid.shape[0], 1, D))
    return np.concatenate([feats[0], np.concatenate([grid, nl], axis=1).reshape(-1, D)], axis=0)
