"""Image inputs of chat requests for multimodal models: data URLs decoded, http(s) URLs fetched
(aiohttp, under a timeout and a size limit), then preprocessed into the engine's MultiModalPrompt.
Every failure is a 400 naming the problem."""

from __future__ import annotations

import asyncio
import os

import aiohttp

from jaxserve.server.errors import bad_request
from jaxserve.server.sampling import chat_prompt_ids

MAX_IMAGES = int(os.environ.get("JAXSERVE_MAX_IMAGES", 8))  # per request
FETCH_TIMEOUT_S = float(os.environ.get("JAXSERVE_IMAGE_FETCH_TIMEOUT", 10))
MAX_FETCH_BYTES = int(float(os.environ.get("JAXSERVE_IMAGE_MAX_MB", 20)) * 2**20)


async def _fetch(url: str) -> bytes:
    try:
        timeout = aiohttp.ClientTimeout(total=FETCH_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as s, s.get(url) as r:
            if r.status != 200:
                raise bad_request(f"fetching image {url[:80]!r} failed: HTTP {r.status}", "messages")
            data = bytearray()
            async for chunk in r.content.iter_chunked(1 << 16):
                data += chunk
                if len(data) > MAX_FETCH_BYTES:
                    raise bad_request(f"image {url[:80]!r} is larger than {MAX_FETCH_BYTES} bytes", "messages")
            return bytes(data)
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise bad_request(f"fetching image {url[:80]!r} failed: {type(e).__name__} {e}".strip(), "messages") from None


async def chat_prompt(state, messages, add_generation_prompt, funcs=None, template_kwargs=None):
    """(token ids, MultiModalPrompt or None) of a chat request: a multimodal model's messages keep
    their image parts (sampling.chat_prompt_ids collects them), a text model refuses them."""
    images = [] if getattr(state.engine, "vision", None) is not None else None
    ids, text = chat_prompt_ids(state, messages, add_generation_prompt, funcs, template_kwargs, images, with_text=True)
    if not images:
        return ids, None
    mm = await multimodal_prompt(state.engine, ids, images, text)
    return mm.token_ids, mm


async def multimodal_prompt(engine, ids: list[int], sources: list, text: str | None = None):
    """The engine's MultiModalPrompt for a chat prompt's token ids and its image sources (URL strings)."""
    from jaxserve.engine.multimodal import MultiModalError
    from jaxserve.loader import image as image_mod

    if len(sources) > MAX_IMAGES:
        raise bad_request(f"{len(sources)} images in one request; at most {MAX_IMAGES}", "messages")
    raw = []
    for src in sources:
        if not isinstance(src, str):
            raise bad_request("an image_url part needs {\"url\": \"data:...\" or \"http(s)://...\"}", "messages")
        if src.startswith(("http://", "https://")):
            raw.append(await _fetch(src))
        elif src.startswith("data:"):
            raw.append(src)
        else:
            raise bad_request(f"image URL {src[:40]!r}: only data: and http(s): URLs are supported", "messages")

    def build():  # decoding and resizing are CPU work: off the event loop
        imgs = [image_mod.decode_data_url(r) if isinstance(r, str) else image_mod.decode_image(r) for r in raw]
        return engine.multimodal_prompt(ids, imgs, text)

    try:
        return await asyncio.to_thread(build)
    except (image_mod.ImageError, MultiModalError) as e:
        raise bad_request(str(e), "messages") from None
