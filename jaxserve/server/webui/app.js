// jaxserve's chat page: streams /v1/chat/completions (SSE) into the page. Plain browser JavaScript, no
// build step and nothing fetched from elsewhere (the machines serving it may be offline). The pure
// helpers at the top are exported for tests/test_webui.py, which runs them under node.
"use strict";

// Split a growing SSE text buffer into complete `data:` payloads; returns [payloads, rest of buffer].
function takeEvents(buffer) {
  const events = [];
  let cut;
  while ((cut = buffer.search(/\r?\n\r?\n/)) >= 0) {
    const block = buffer.slice(0, cut);
    buffer = buffer.slice(cut).replace(/^\r?\n\r?\n/, "");
    const data = block.split(/\r?\n/).filter((l) => l.startsWith("data:"))
      .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
    if (data) events.push(data);
  }
  return [events, buffer];
}

function escapeHtml(s) {
  return s.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
}

// Markdown, the little that chat replies lean on: ``` fenced code blocks and `inline code`; everything
// else stays text. Model output is escaped first: it never becomes markup.
function renderMarkdown(text) {
  const parts = text.split(/```/);
  return parts.map((part, i) => {
    if (i % 2 === 1) {  // inside a fence (an unclosed last fence too: it is still streaming)
      const body = part.replace(/^[\w+-]*\n/, "");
      return "<pre><code>" + escapeHtml(body) + "</code></pre>";
    }
    return escapeHtml(part).replace(/`([^`\n]+)`/g, "<code>$1</code>");
  }).join("");
}

// The request body for the conversation so far.
function chatBody(model, messages, system, temperature, maxTokens) {
  const msgs = system ? [{ role: "system", content: system }, ...messages] : messages.slice();
  const body = { model, messages: msgs, stream: true, stream_options: { include_usage: true } };
  if (temperature !== "" && temperature !== null && !Number.isNaN(Number(temperature))) body.temperature = Number(temperature);
  if (maxTokens) body.max_tokens = Number(maxTokens);
  return body;
}

// A user turn: plain text, or (with attached images, as data: URLs) OpenAI's content parts.
function userMessage(text, images) {
  if (!images || !images.length) return { role: "user", content: text };
  const parts = images.map((url) => ({ type: "image_url", image_url: { url } }));
  if (text) parts.push({ type: "text", text });
  return { role: "user", content: parts };
}

if (typeof module !== "undefined") {
  module.exports = { takeEvents, escapeHtml, renderMarkdown, chatBody, userMessage };
} else {
  const $ = (id) => document.getElementById(id);
  const log = $("log"), input = $("input"), send = $("send");
  const messages = [];
  let controller = null;
  let images = [];  // the next turn's attachments (data: URLs)
  for (const id of ["temperature", "max_tokens", "system", "apikey"]) {  // settings survive a reload
    const v = localStorage.getItem("jaxserve." + id);
    if (v !== null) $(id).value = v;
    $(id).addEventListener("change", () => localStorage.setItem("jaxserve." + id, $(id).value));
  }
  const headers = () => {
    const h = { "Content-Type": "application/json" };
    if ($("apikey").value) h.Authorization = "Bearer " + $("apikey").value;
    return h;
  };

  function addMessage(role, cls) {
    const div = document.createElement("div");
    div.className = "msg " + (cls || role);
    div.innerHTML = '<div class="role"></div><details hidden><summary>thinking</summary><div class="think"></div>' +
      '</details><div class="body"></div><div class="stats"></div>';
    div.querySelector(".role").textContent = role;
    log.appendChild(div);
    log.scrollTop = log.scrollHeight;
    return div;
  }

  async function errorText(resp) {
    try { const j = await resp.json(); return (j.error && j.error.message) || JSON.stringify(j); }
    catch (e) { return resp.status + " " + resp.statusText; }
  }

  async function loadModels() {
    try {
      const resp = await fetch("v1/models", { headers: headers() });
      if (!resp.ok) throw new Error(await errorText(resp));
      const sel = $("model");
      sel.innerHTML = "";
      for (const m of (await resp.json()).data) {
        const o = document.createElement("option");
        o.value = o.textContent = m.id;
        sel.appendChild(o);
      }
    } catch (e) {
      addMessage("error", "error").querySelector(".body").textContent = "could not list models: " + e.message;
    }
  }

  // Images only when the server says the model takes them (GET /props, llama.cpp's endpoint).
  async function loadProps() {
    try {
      const resp = await fetch("props", { headers: headers() });
      if (resp.ok) $("attach").hidden = !((await resp.json()).modalities || {}).vision;
    } catch (e) { /* an older server: no attachments */ }
  }

  function showThumbs() {
    const t = $("thumbs");
    t.innerHTML = "";
    images.forEach((url, i) => {
      const img = document.createElement("img");
      img.src = url;
      img.title = "remove";
      img.addEventListener("click", () => { images.splice(i, 1); showThumbs(); });
      t.appendChild(img);
    });
  }

  function readAsDataURL(file) {
    return new Promise((resolve, reject) => {
      const r = new FileReader();
      r.onload = () => resolve(r.result);
      r.onerror = () => reject(r.error);
      r.readAsDataURL(file);
    });
  }

  async function chat() {
    const text = input.value;
    if ((!text.trim() && !images.length) || controller) return;
    input.value = "";
    const sent = images;
    images = [];
    showThumbs();
    messages.push(userMessage(text, sent));
    const mine = addMessage("user").querySelector(".body");
    for (const url of sent) {
      const img = document.createElement("img");
      img.src = url;
      mine.appendChild(img);
    }
    mine.appendChild(document.createTextNode(text));
    const div = addMessage("assistant");
    const body = div.querySelector(".body"), think = div.querySelector(".think"), stats = div.querySelector(".stats");
    let content = "", thought = "", usage = null, buffer = "";
    const t0 = performance.now();
    let tFirst = null;
    controller = new AbortController();
    send.textContent = "stop";
    try {
      const resp = await fetch("v1/chat/completions", {
        method: "POST", headers: headers(), signal: controller.signal,
        body: JSON.stringify(chatBody($("model").value, messages, $("system").value, $("temperature").value,
                                      $("max_tokens").value)),
      });
      if (!resp.ok) throw new Error(await errorText(resp));
      const reader = resp.body.getReader(), decoder = new TextDecoder();
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        let events;
        [events, buffer] = takeEvents(buffer + decoder.decode(value, { stream: true }));
        for (const ev of events) {
          if (ev === "[DONE]") continue;
          const chunk = JSON.parse(ev);
          if (chunk.error) throw new Error(chunk.error.message);
          if (chunk.usage) usage = chunk.usage;
          const delta = (chunk.choices && chunk.choices[0] && chunk.choices[0].delta) || {};
          if (delta.content || delta.reasoning_content) tFirst = tFirst || performance.now();
          if (delta.reasoning_content) {
            thought += delta.reasoning_content;
            think.parentElement.hidden = false;
            think.textContent = thought;
          }
          if (delta.content) {
            content += delta.content;
            body.innerHTML = renderMarkdown(content);
          }
          log.scrollTop = log.scrollHeight;
        }
      }
      messages.push({ role: "assistant", content });
    } catch (e) {
      if (e.name === "AbortError") {
        messages.push({ role: "assistant", content });  // what came before the stop stays in the history
      } else {
        messages.pop();  // the failed turn is not part of the conversation
        div.className = "msg error";
        body.textContent = (content ? content + "\n\n" : "") + "error: " + e.message;
      }
    } finally {
      controller = null;
      send.textContent = "send";
      const t1 = performance.now();
      if (usage && tFirst) {
        const rate = usage.completion_tokens > 1 ? (usage.completion_tokens - 1) / ((t1 - tFirst) / 1000) : 0;
        stats.textContent = `${usage.prompt_tokens} prompt tokens, ${usage.completion_tokens} generated; first ` +
          `token ${((tFirst - t0) / 1000).toFixed(2)} s, ${rate.toFixed(1)} tokens/s`;
      }
    }
  }

  send.addEventListener("click", () => (controller ? controller.abort() : chat()));
  $("attach").addEventListener("click", () => $("files").click());
  $("files").addEventListener("change", async () => {
    for (const f of $("files").files) images.push(await readAsDataURL(f));
    $("files").value = "";
    showThumbs();
  });
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); chat(); }
  });
  $("clear").addEventListener("click", () => { if (!controller) { messages.length = 0; log.innerHTML = ""; } });
  $("apikey").addEventListener("change", () => { loadModels(); loadProps(); });
  loadModels();
  loadProps();
}
