"""`jaxserve run`: the aiohttp application and its lifecycle.

Start-up order: validate the engine flags, bind the socket and answer /health with 503, load and
compile the model on a background thread, then start the engine thread and answer 200. SIGTERM or
SIGINT: stop accepting (503), let in-flight requests finish for a grace period, abort the rest, exit.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import signal
import stat
import sys
import threading
import time

from aiohttp import web

from jaxserve.server.errors import APIError
from jaxserve.server.routes import BODY_TIMEOUT, MAX_BODY, STATE, add_routes, add_webui
from jaxserve.server.state import ServerState

log = logging.getLogger("jaxserve.server")

# no API key needed: probes, and the chat page itself (its API calls send the key)
_OPEN_PATHS = {"/health", "/v1/health", "/metrics", "/v1/metrics", "/", "/webui/app.js"}


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


# ----------------------------------------------------------------------------- binding

def parse_bind(host: str | None, port: int) -> tuple:
    """('unix', path) or ('tcp', host, port) from --host (host, host:port, [v6]:port, unix:///path)."""
    host = (host or "127.0.0.1").strip()
    if host.startswith("unix://"):
        path = host[len("unix://"):]
        if not path:
            raise ValueError("unix:// needs a socket path, e.g. unix:///tmp/jaxserve.sock")
        return ("unix", path)
    if host.startswith("["):
        h, sep, rest = host[1:].partition("]")
        if not sep:
            raise ValueError(f"bad IPv6 address {host!r}: missing ']'")
        if rest:
            if not rest.startswith(":"):
                raise ValueError(f"bad host {host!r}")
            port = int(rest[1:])
        return ("tcp", h, port)
    if host.count(":") == 1:
        h, p = host.rsplit(":", 1)
        return ("tcp", h or "0.0.0.0", int(p))
    return ("tcp", host, port)  # a name, an IPv4 address or a bare IPv6 address


def bind_url(bind: tuple) -> str:
    if bind[0] == "unix":
        return f"unix://{bind[1]}"
    h = f"[{bind[1]}]" if ":" in bind[1] else bind[1]
    return f"http://{h}:{bind[2]}"


async def _start_site(runner: web.AppRunner, bind: tuple) -> web.BaseSite:
    if bind[0] == "unix":
        path = bind[1]
        if os.path.exists(path):
            if not stat.S_ISSOCK(os.stat(path).st_mode):
                raise OSError(f"{path} exists and is not a socket")
            os.unlink(path)  # a stale socket from an earlier run
        site = web.UnixSite(runner, path)
    else:
        site = web.TCPSite(runner, bind[1], bind[2], reuse_address=True)
    await site.start()
    return site


# ----------------------------------------------------------------------------- middlewares

def _route_label(request: web.Request) -> str:
    info = request.match_info
    route = getattr(info, "route", None)
    res = getattr(route, "resource", None)
    if res is None or getattr(info, "http_exception", None) is not None:
        return "unmatched"
    return res.canonical


@web.middleware
async def error_middleware(request: web.Request, handler):
    """Every error leaves as OpenAI JSON; nothing a client sends gives a bare 500 page."""
    state = request.app[STATE]
    status = 500
    try:
        resp = await handler(request)
        status = resp.status
        return resp
    except APIError as e:
        status = e.status
        return e.response()
    except web.HTTPException as e:
        status = e.status
        if e.status < 400:
            raise
        if e.status == 413:
            msg = f"the request body is too large (limit {request.app[MAX_BODY]} bytes)"
        elif e.status == 404:
            msg = f"no such endpoint: {request.method} {request.path}"
        elif e.status == 405:
            msg = f"method {request.method} is not allowed on {request.path}"
        else:
            msg = e.reason or e.text or "request error"
        headers = {k: v for k, v in e.headers.items() if k.lower() == "allow"}
        return APIError(e.status, msg).response(headers=headers)
    except asyncio.CancelledError:
        status = 499  # client closed the connection
        raise
    except Exception as e:
        from jaxserve.server.streaming import is_disconnect

        if is_disconnect(e):
            status = 499
            raise
        log.exception("unhandled error on %s %s", request.method, request.path)
        return APIError(500, f"internal server error: {type(e).__name__}").response()
    finally:
        state.metrics.requests.labels(_route_label(request), str(status)).inc()


def _auth_middleware(api_key: str):
    key = api_key.encode()

    @web.middleware
    async def auth(request: web.Request, handler):
        if request.method != "OPTIONS" and request.path not in _OPEN_PATHS:
            got = request.headers.get("Authorization", "")
            token = got[7:].strip() if got[:7].lower() == "bearer " else ""
            if not token or not hmac.compare_digest(token.encode(), key):
                raise APIError(401, "Incorrect API key provided." if token else
                               "Missing API key: send 'Authorization: Bearer <key>'.",
                               code="invalid_api_key")
        return await handler(request)

    return auth


def _cors(app: web.Application, origins: list[str]) -> None:
    any_origin = "*" in origins

    def allowed(origin: str | None) -> str | None:
        if not origin:
            return None
        return "*" if any_origin else (origin if origin in origins else None)

    @web.middleware
    async def preflight(request: web.Request, handler):
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            allow = allowed(request.headers.get("Origin"))
            if allow is None:
                raise APIError(403, "CORS origin not allowed")
            return web.Response(status=204, headers={
                "Access-Control-Allow-Origin": allow,
                "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                "Access-Control-Allow-Headers": request.headers.get("Access-Control-Request-Headers",
                                                                    "Authorization, Content-Type"),
                "Access-Control-Max-Age": "600",
                "Vary": "Origin",
            })
        return await handler(request)

    async def add_headers(request: web.Request, response: web.StreamResponse) -> None:
        allow = allowed(request.headers.get("Origin"))
        if allow is not None:
            response.headers["Access-Control-Allow-Origin"] = allow
            response.headers["Vary"] = "Origin"

    app.middlewares.append(preflight)
    app.on_response_prepare.append(add_headers)


def build_app(state: ServerState) -> web.Application:
    max_body = int(_env_float("JAXSERVE_MAX_BODY_MB", 16) * 2**20)
    app = web.Application(client_max_size=max_body, middlewares=[error_middleware])
    app[STATE] = state
    app[MAX_BODY] = max_body
    app[BODY_TIMEOUT] = _env_float("JAXSERVE_BODY_TIMEOUT", 60.0)  # 0 or less: no limit
    origins = [o.strip() for o in (getattr(state.args, "cors_origins", None) or "").split(",") if o.strip()]
    if origins:
        _cors(app, origins)
    if getattr(state.args, "api_key", None):
        app.middlewares.append(_auth_middleware(state.args.api_key))
    add_routes(app)
    if not getattr(state.args, "no_webui", False):
        add_webui(app)
    return app


# ----------------------------------------------------------------------------- loading

def _load_engine(args, ecfg):
    # One device, or tp/dp/multi-host layouts: the same builder as the offline API.
    from jaxserve.engine.structured import StructuredOutputError
    from jaxserve.parallel.launch import engine_from_args

    from jaxserve.engine.embedder import EmbeddingEngine, is_embedding_model

    task, overrides = getattr(args, "task", "auto"), getattr(args, "hf_overrides", None)
    if is_embedding_model(args.model, getattr(args, "revision", None), task, overrides):
        if ecfg.lora or ecfg.lora_modules or ecfg.max_loras:
            raise ValueError("--lora, --lora-modules and --max-loras adapters apply to generative models only")
        return EmbeddingEngine(args.model, dtype=ecfg.dtype, revision=getattr(args, "revision", None),
                               max_model_len=getattr(args, "max_model_len", None), task=task,
                               hf_overrides=overrides)
    if overrides:
        raise ValueError("--hf-overrides applies to pooling models (--task embed or classify) only")
    if task in ("embed", "classify"):
        raise ValueError(f"--task {task} needs a Hugging Face safetensors model (directory or Hub id) with "
                         "tokenizer.json")
    engine = engine_from_args(args, ecfg)
    if engine is not None:
        def prebuild():
            try:
                _ = engine.grammar_compiler.lltokenizer
            except StructuredOutputError as e:
                log.warning("%s", e)  # such requests get this as a 400

        # structured output's view of the tokenizer (0.2 s for 49k tokens, 2.5 s for 262k): built beside
        # the server's start, not in its path nor in the first constrained request (which waits on its lock)
        threading.Thread(target=prebuild, name="jaxserve-grammar", daemon=True).start()
    return engine


def _in_thread(fn, *a) -> asyncio.Future:
    """Run fn on a daemon thread (an executor thread would keep a SIGTERMed process alive)."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def target():
        try:
            res = fn(*a)
        except BaseException as e:  # noqa: BLE001 - handed to the loop
            loop.call_soon_threadsafe(lambda err=e: fut.done() or fut.set_exception(err))
        else:
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(res))

    threading.Thread(target=target, name="jaxserve-load", daemon=True).start()
    return fut


async def _main(state: ServerState, bind: tuple, ecfg) -> int:
    from jaxserve.engine.async_engine import AsyncEngine

    args = state.args
    app = build_app(state)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           shutdown_timeout=_env_float("JAXSERVE_SHUTDOWN_TIMEOUT", 10.0))
    await runner.setup()
    try:
        await _start_site(runner, bind)
    except (OSError, ValueError) as e:
        print(f"jaxserve: error: cannot listen on {bind_url(bind)}: {e}", file=sys.stderr, flush=True)
        await runner.cleanup()
        return 1
    url = bind_url(bind)
    print(f"jaxserve: listening on {url} (loading the model; /health answers 503 until it is ready)", flush=True)

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass

    t0 = time.monotonic()
    load = _in_thread(_load_engine, args, ecfg)
    stop_wait = asyncio.ensure_future(stop.wait())
    await asyncio.wait({load, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
    rc = 0
    if not load.done():  # stopped while loading
        state.shutting_down = True
        print("jaxserve: stopped while loading", file=sys.stderr, flush=True)
        await runner.cleanup()
        _cleanup_unix(bind)
        return 0
    try:
        engine = load.result()
    except Exception as e:
        state.load_error = f"{type(e).__name__}: {e}"
        log.debug("model load failed", exc_info=True)
        print(f"jaxserve: error: could not load the model: {e}", file=sys.stderr, flush=True)
        stop_wait.cancel()
        await runner.cleanup()
        _cleanup_unix(bind)
        return 2
    if getattr(engine, "is_embedding", False):
        aengine = None
        state.attach(engine, None)
        state.ready = True
        what = f"{engine.cfg.num_labels} labels" if engine.is_classifier else f"{engine.dim} dimensions"
        print(f"jaxserve: pooling model {state.model_name} ({engine.model.name}) ready in "
              f"{time.monotonic() - t0:.1f}s; {what}, inputs up to {engine.ecfg.max_model_len} "
              f"tokens; serving {engine.routes} on {url}", flush=True)
    else:
        aengine = AsyncEngine(engine, max_queue=max(0, int(getattr(args, "max_queue", 256) or 0)),
                              on_step=state.metrics.on_step)
        aengine.start(loop)
        state.attach(engine, aengine)
        state.ready = True
        bs = engine.ecfg.block_size
        print(f"jaxserve: model {state.model_name} ({engine.model.name}) ready in {time.monotonic() - t0:.1f}s; "
              f"KV cache {engine.kv_capacity_tokens} tokens ({engine.kv_capacity_tokens // bs} blocks of {bs}); "
              f"max_model_len {engine.ecfg.max_model_len}; serving on {url}", flush=True)

    await stop_wait
    print("jaxserve: shutting down: finishing in-flight requests", file=sys.stderr, flush=True)
    state.shutting_down = True
    if aengine is not None:
        await aengine.shutdown(_env_float("JAXSERVE_SHUTDOWN_GRACE", 30.0))
    await runner.cleanup()
    _cleanup_unix(bind)
    print("jaxserve: stopped", file=sys.stderr, flush=True)
    return rc


def _cleanup_unix(bind: tuple) -> None:
    if bind[0] == "unix":
        try:
            os.unlink(bind[1])
        except OSError:
            pass


def _check_lora_modules(state: ServerState, ecfg) -> None:
    """--lora-modules before binding: each an adapter directory, its name not a name of the base model
    (a request's `model` picks one or the other)."""
    from jaxserve.engine.llm_engine import DEFAULT_MODEL
    from jaxserve.loader.lora import adapter_config

    base = {state.args.model or DEFAULT_MODEL, getattr(state.args, "weights_path", None), *state.served_names}
    for name, path in ecfg.lora_modules:
        if name in base:
            raise ValueError(f"--lora-modules: the adapter name {name!r} is also the base model's name")
        adapter_config(path)
    if getattr(state.args, "enable_lora_loading", False) and ecfg.lora_slots <= len(ecfg.lora_modules):
        raise ValueError(f"--enable-lora-loading needs adapter slots to load into: --max-loras above the number "
                         f"of --lora-modules ({len(ecfg.lora_modules)})")


def serve(args) -> int:
    from jaxserve.cli import engine_config_from_args

    try:
        bind = parse_bind(args.host, args.port)
    except ValueError as e:
        print(f"jaxserve: error: --host: {e}", file=sys.stderr)
        return 2
    ecfg = engine_config_from_args(args)  # bad engine flags fail here, before anything loads
    state = ServerState(args)
    try:
        _check_lora_modules(state, ecfg)
    except ValueError as e:
        print(f"jaxserve: error: {e}", file=sys.stderr)
        return 2
    return asyncio.run(_main(state, bind, ecfg))
