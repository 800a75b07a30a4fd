"""The chat page at / (jaxserve/server/webui): served without an API key unless --no-webui; its script's
helpers run under node (when installed): the SSE splitter on a real server stream cut at odd places
(tests/test_server_tiny.py feeds it one), the markdown renderer escapes model output, the request body."""

import asyncio
import json
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

APP_JS = Path(__file__).parent.parent / "jaxserve" / "server" / "webui" / "app.js"


def node(code: str, stdin: str = "") -> str:
    """Run `code` under node with app.js's helpers as `w`; its stdout."""
    if shutil.which("node") is None:
        pytest.skip("node is not installed")
    r = subprocess.run(["node", "-e", f"const w = require({json.dumps(str(APP_JS))});\n{code}"], input=stdin,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def sse_content(raw: str, piece: int) -> str:
    """The content deltas of a raw SSE chat stream, fed to the page's splitter `piece` characters at a time."""
    return node(f"""
const raw = require("fs").readFileSync(0, "utf8");
let buf = "", out = "", done = false;
for (let i = 0; i < raw.length; i += {piece}) {{
  let ev;
  [ev, buf] = w.takeEvents(buf + raw.slice(i, i + {piece}));
  for (const e of ev) {{
    if (e === "[DONE]") {{ done = true; continue; }}
    const c = JSON.parse(e);
    if (c.choices && c.choices.length) out += c.choices[0].delta.content || "";
  }}
}}
if (!done || buf.trim()) throw new Error("stream not fully consumed: " + buf);
process.stdout.write(out);""", raw)


def test_script_helpers():
    got = json.loads(node("""
const [ev, rest] = w.takeEvents('data: {"a":1}\\r\\n\\r\\ndata: x\\ndata: y\\n\\n: comment\\n\\ndata: part');
console.log(JSON.stringify({ev, rest,
  md: w.renderMarkdown("a <b>&\\n```py\\nif x<1: `y`\\n```\\nuse `z<2` now\\n```\\nstreaming"),
  body: w.chatBody("m", [{role: "user", content: "hi"}], "be brief", "0", "64"),
  plain: w.chatBody("m", [], "", "", ""),
  turn: w.userMessage("what is it?", ["data:image/png;base64,AAAA"]), text: w.userMessage("hi", [])}));"""))
    assert got["ev"] == ['{"a":1}', "x\ny"] and got["rest"] == "data: part"
    assert got["md"] == ("a &lt;b&gt;&amp;\n<pre><code>if x&lt;1: `y`\n</code></pre>\nuse <code>z&lt;2</code> now\n"
                         "<pre><code>streaming</code></pre>")
    assert got["body"] == {"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                                      {"role": "user", "content": "hi"}],
                           "stream": True, "stream_options": {"include_usage": True}, "temperature": 0,
                           "max_tokens": 64}
    assert "temperature" not in got["plain"] and "max_tokens" not in got["plain"]
    # a turn with attached images: OpenAI's content parts (image_url data: URLs, then the text)
    assert got["turn"] == {"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, {"type": "text", "text": "what is it?"}]}
    assert got["text"] == {"role": "user", "content": "hi"}


@pytest.mark.parametrize("off", [False, True])
def test_page_routes(off):
    """/ and /webui/app.js answer before the model is loaded and without the API key; --no-webui: 404s."""
    from aiohttp.test_utils import TestClient, TestServer

    from jaxserve.server.app import build_app
    from jaxserve.server.state import ServerState

    async def run():
        state = ServerState(SimpleNamespace(api_key="k", no_webui=off))
        async with TestClient(TestServer(build_app(state))) as client:
            page, script = await client.get("/"), await client.get("/webui/app.js")
            models = await client.get("/v1/models")
            return (page.status, page.content_type, await page.text(), script.status, script.content_type,
                    models.status)

    status, ctype, text, js_status, js_type, models = asyncio.run(run())
    assert models == 401  # the API itself still wants the key
    if off:
        assert (status, js_status) == (404, 404)
    else:
        assert (status, ctype, js_status, js_type) == (200, "text/html", 200, "application/javascript")
        assert '<script src="webui/app.js">' in text
        assert 'id="attach"' in text and 'type="file" accept="image/*"' in text  # shown for vision models
