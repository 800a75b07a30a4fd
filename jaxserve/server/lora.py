"""LoRA adapters while serving. vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter: off unless the
server was started with --enable-lora-loading (a load reads any directory the server process can
read); adapters go into free adapter slots (--max-loras); a loaded adapter is a model name for every
generation endpoint and is listed by /v1/models. llama.cpp's GET/POST /lora-adapters: the loaded
adapters by id (slot - 1) and the scales that requests naming no adapter run with (none by default)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from aiohttp import web

from jaxserve.server.errors import APIError, bad_request
from jaxserve.server.protocol import LoraScale, _Req, parse_request


# How long a load waits for a slot that running requests still hold (then a 400)
LOAD_WAIT_S = 60.0


class LoadLoRAAdapterRequest(_Req):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(_Req):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's numeric id: accepted, the name identifies the adapter


def _require_loading(state) -> None:
    if not getattr(state.args, "enable_lora_loading", False):
        raise APIError(404, "loading LoRA adapters while serving is off: start the server with "
                       "--enable-lora-loading (and --max-loras above the number of --lora-modules)",
                       code="not_found")
    state.require_generative()


async def load_lora_adapter(request: web.Request, state, body) -> web.Response:
    from jaxserve.engine.lora_slots import LoraSlotError, LoraSlotsFull
    from jaxserve.loader.lora import LoraError

    _require_loading(state)
    req = parse_request(LoadLoRAAdapterRequest, body)
    name = req.lora_name.strip()
    if not name or not req.lora_path.strip():
        raise bad_request("lora_name and lora_path must not be empty", "lora_name" if not name else "lora_path")
    if name in state.accepted_names or name in state.served_names:
        raise bad_request(f"{name!r} is the base model's name; an adapter needs a name of its own", "lora_name")
    if name in state.adapters:
        raise bad_request(f"The lora adapter '{name}' has already been loaded.", "lora_name")
    eng = state.engine
    try:  # read off both the event loop and the engine thread; only the slot write runs on the latter
        stacks = await asyncio.get_running_loop().run_in_executor(None, eng.prepare_lora, req.lora_path)
    except LoraSlotError as e:
        raise bad_request(str(e), "lora_name") from None
    except (ValueError, OSError) as e:  # LoraError, or a corrupt file (a bad safetensors header, ...)
        raise bad_request(str(e) if isinstance(e, LoraError) else f"{req.lora_path}: {type(e).__name__}: {e}",
                          "lora_path") from None
    loop = asyncio.get_running_loop()
    deadline = loop.time() + LOAD_WAIT_S
    while True:
        try:
            await state.aengine.call(lambda: eng.add_lora(name, req.lora_path, stacks))
            break
        except LoraSlotsFull as e:
            # a slot that frees when running requests end (an unloaded adapter's, an on-demand one's): wait
            # for it, as vLLM queues such loads; every slot held by a loaded adapter: refused at once
            if not eng.lora.may_free() or loop.time() > deadline:
                raise bad_request(str(e) + (f" (waited {LOAD_WAIT_S:.0f} s)" if eng.lora.may_free() else ""),
                                  "lora_name") from None
            await asyncio.sleep(0.05)
        except LoraSlotError as e:
            raise bad_request(str(e), "lora_name") from None
    state.adapters = dict(eng.lora_paths)
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request, state, body) -> web.Response:
    from jaxserve.engine.lora_slots import LoraSlotError

    _require_loading(state)
    req = parse_request(UnloadLoRAAdapterRequest, body)
    if req.lora_name not in state.adapters:
        raise APIError(404, f"The lora adapter '{req.lora_name}' cannot be found.", "lora_name", "not_found")
    eng = state.engine
    try:
        await state.aengine.call(lambda: eng.remove_lora(req.lora_name))
    except LoraSlotError as e:  # unloaded meanwhile by another request
        raise APIError(404, str(e), "lora_name", "not_found") from None
    state.adapters = dict(eng.lora_paths)
    state.lora_scales = {n: s for n, s in state.lora_scales.items() if n != req.lora_name}
    return web.Response(text=f"Success: LoRA adapter '{req.lora_name}' removed successfully.")


def list_lora_adapters(state) -> web.Response:
    """llama.cpp's GET /lora-adapters: [{"id", "path", "scale"}] of the loaded adapters."""
    ids = state.lora_ids()
    return web.json_response([{"id": i, "path": state.adapters.get(n, ""), "scale": state.lora_scales.get(n, 0.0)}
                              for i, n in sorted(ids.items())])


async def set_lora_adapters(request: web.Request, state, body) -> web.Response:
    """llama.cpp's POST /lora-adapters [{"id", "scale"}]: the mixture requests naming no adapter run with
    (adapters left out: scale 0)."""
    state.require_generative()
    if not isinstance(body, list):
        raise bad_request("the body must be a JSON list of {\"id\", \"scale\"} objects")
    items = [parse_request(LoraScale, item) for item in body]
    mix = state.lora_for(SimpleNamespace(lora=items, model=None))
    state.engine.lora_slot(mix)  # the scales' checks (finite numbers)
    state.lora_scales = {n: s for n, s in mix.items() if s != 0}
    return web.json_response({"success": True})
