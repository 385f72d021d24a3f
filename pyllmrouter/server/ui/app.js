// pyllmrouter's page: devices, models, events and a chat, from the server's own API.
//
//   /models (one snapshot: models, their bytes per device and parts, devices) ──▶ render()
//   /models/sse (fetch-streamed: EventSource cannot send the API key) ──▶ events list
//                                                                       + refresh() soon after
//   /v1/chat/completions (stream) ──▶ chat log; Stop aborts the request, the server cancels it
//
// The API key lives in localStorage only and goes out as "Authorization: Bearer".
"use strict";
(() => {
  const KEY = "pyllmrouter-api-key", THEME = "pyllmrouter-theme";
  const $ = (id) => document.getElementById(id);
  const MiB = 1048576;
  const fmt = (n) => (Math.abs(n) >= 1024 * MiB ? (n / 1024 / MiB).toFixed(2) + " GiB" : (n / MiB).toFixed(2) + " MiB");
  const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
  const COMPONENTS = ["weights", "kv", "compute", "output", "cache", "projector", "draft", "lora", "checkpoints", "other"];
  const KINDS = { overhead: "our workers", kept: "kept prompt states", external: "other programs",
                  margin: "margin", reserved: "outside the budget", free: "free" };
  const view = { models: [], devices: {}, timer: null, keyWaiters: [], started: Date.now(), progress: {} };

  class AuthError extends Error {}

  // -- the API ------------------------------------------------------------------
  function withKey(extra) {
    const h = Object.assign({}, extra || {});
    const key = localStorage.getItem(KEY);
    if (key) h.Authorization = "Bearer " + key;
    return h;
  }

  async function errorText(res) {
    try {
      const j = await res.json();
      return (j.error && j.error.message) || res.statusText;
    } catch (e) {
      return res.statusText;
    }
  }

  async function api(path, opts) {
    opts = opts || {};
    const res = await fetch(path, Object.assign({}, opts, { headers: withKey(opts.headers) }));
    if (res.status === 401) {
      showAuth(await errorText(res));
      throw new AuthError("API key");
    }
    return res;
  }

  function showAuth(msg) {
    $("auth-msg").textContent = localStorage.getItem(KEY)
      ? "The server refused this browser's API key (" + msg + "). Enter the key the server was started with."
      : "This server asks for an API key (" + msg + ").";
    $("auth").hidden = false;
    setLive(false, "API key needed");
  }

  function keyGiven() {
    return new Promise((resolve) => view.keyWaiters.push(resolve));
  }

  // -- devices --------------------------------------------------------------------
  function hue(name) {
    let h = 0;
    for (const c of name) h = (h * 31 + c.charCodeAt(0)) >>> 0;
    return (h * 137) % 360;
  }

  function modelColor(model, component) {
    const i = Math.max(0, COMPONENTS.indexOf(component));
    return "hsl(" + hue(model) + ", 58%, " + (34 + i * 6) + "%)";
  }

  function segmentsOf(name, d) {
    const segs = [];
    for (const m of view.models) {
      const parts = m.memory && m.memory.parts && m.memory.parts[name];
      if (!parts) continue;
      for (const comp of COMPONENTS) {
        if (parts[comp]) segs.push({ kind: "model", model: m.id, component: comp, bytes: parts[comp] });
      }
    }
    for (const kind of ["overhead", "kept", "external"]) {
      if (d[kind] > 0) segs.push({ kind, bytes: d[kind] });
    }
    const used = segs.reduce((a, s) => a + s.bytes, 0);
    const free = Math.max(0, d.available == null ? d.total - used : d.available);
    const margin = Math.min(d.margin || 0, Math.max(0, d.total - used - free));
    if (margin > 0) segs.push({ kind: "margin", bytes: margin });
    const reserved = d.total - used - free - margin;
    if (reserved > 0) segs.push({ kind: "reserved", bytes: reserved });
    if (free > 0) segs.push({ kind: "free", bytes: free });
    return segs;
  }

  function renderDevices() {
    const box = $("devices");
    box.textContent = "";
    const names = Object.keys(view.devices).sort((a, b) => (a === "CPU") - (b === "CPU") || a.localeCompare(b));
    const seen = new Set();
    for (const name of names) {
      const d = view.devices[name];
      const row = document.createElement("div");
      row.className = "device";
      row.dataset.device = name;
      const label = document.createElement("div");
      label.className = "name";
      label.textContent = name === "CPU" ? "CPU (host)" : name;
      const kind = document.createElement("small");
      kind.textContent = d.kind;
      label.appendChild(kind);
      const bar = document.createElement("div");
      bar.className = "bar";
      bar.dataset.device = name;
      bar.dataset.total = d.total;
      const segs = segmentsOf(name, d);
      const scale = Math.max(d.total, segs.reduce((a, s) => a + s.bytes, 0));
      for (const s of segs) {
        const el = document.createElement("div");
        el.className = "seg";
        el.dataset.kind = s.kind;
        el.dataset.bytes = s.bytes;
        el.style.width = (100 * s.bytes / scale) + "%";
        if (s.kind === "model") {
          el.dataset.model = s.model;
          el.dataset.component = s.component;
          el.style.background = modelColor(s.model, s.component);
          el.title = s.model + " · " + s.component + " · " + fmt(s.bytes);
          seen.add(s.model);
        } else {
          el.title = KINDS[s.kind] + " · " + fmt(s.bytes);
        }
        bar.appendChild(el);
      }
      const sum = document.createElement("div");
      sum.className = "sum";
      sum.textContent = "held " + fmt(d.held) + " of " + fmt(d.total) + " · available " + fmt(Math.max(0, d.available));
      row.append(label, bar, sum);
      box.appendChild(row);
    }
    const legend = $("legend");
    legend.textContent = "";
    const item = (bg, text) => {
      const span = document.createElement("span");
      const sw = document.createElement("i");
      sw.className = "swatch";
      sw.style.background = bg;
      span.append(sw, text);
      legend.appendChild(span);
    };
    for (const m of [...seen].sort()) item(modelColor(m, "weights"), m);
    if (seen.size) legend.append("(a model's shades, darkest first: " + COMPONENTS.slice(0, 3).join(", ") + "…; hover for bytes)");
    const css = getComputedStyle(document.documentElement);
    for (const [k, text] of Object.entries(KINDS)) item(css.getPropertyValue("--" + k).trim(), text);
  }

  // -- models ---------------------------------------------------------------------
  function bytesOn(per) {
    return Object.entries(per || {}).map(([d, n]) => d + " " + fmt(n)).join(", ");
  }

  function cell(tr, text, cls) {
    const td = document.createElement("td");
    if (cls) td.className = cls;
    if (text instanceof Node) td.appendChild(text);
    else td.textContent = text == null ? "" : text;
    tr.appendChild(td);
    return td;
  }

  function stateOf(m) {
    const s = m.status || {};
    return s.failed ? "failed" : s.value;
  }

  function renderModels() {
    const body = $("models").querySelector("tbody");
    body.textContent = "";
    $("models-count").textContent = "(" + view.models.length + ")";
    for (const m of view.models) {
      const tr = document.createElement("tr");
      tr.dataset.model = m.id;
      const name = document.createElement("div");
      name.textContent = m.id;
      if (m.aliases && m.aliases.length) {
        const a = document.createElement("div");
        a.className = "alias";
        a.textContent = "alias " + m.aliases.join(", ");
        name.appendChild(a);
      }
      cell(tr, name);
      const st = document.createElement("div");
      const word = document.createElement("span");
      word.className = "state " + stateOf(m);
      word.textContent = (m.status || {}).value + ((m.status || {}).pending ? " (" + m.status.pending + ")" : "");
      st.appendChild(word);
      if (stateOf(m) === "loading" && view.progress[m.id]) showProgress(st, view.progress[m.id]);
      if ((m.instances || []).length > 1) {  // replicas = N: each instance, where it is and how busy
        const list = document.createElement("div");
        list.className = "instances";
        for (const i of m.instances) {
          const line = document.createElement("div");
          const on = Object.keys(i.held || {}).length ? bytesOn(i.held) : (i.devices || []).join("+");
          line.textContent = i.id + ": " + i.state + (on ? " on " + on : "") + ", " + (i.in_flight || 0) + " in flight";
          list.appendChild(line);
        }
        st.appendChild(list);
      }
      if (m.status && m.status.reason) {
        const r = document.createElement("div");
        r.className = "reason";
        r.textContent = m.status.reason;
        st.appendChild(r);
      }
      cell(tr, st, "state-cell");
      const mem = m.memory || {};
      if (mem.held && Object.keys(mem.held).length) cell(tr, bytesOn(mem.held), "num on");
      else {
        const need = Object.entries(mem.requirement || {}).map(([ds, per]) => ds + ": " + bytesOn(per)).join(" | ");
        cell(tr, need ? "needs " + need : "not measured yet", "num on muted");
      }
      cell(tr, String(m.in_flight || 0), "num in-flight");
      const w = m.waiting || {};
      const q = document.createElement("div");
      if (w.requests) {
        q.textContent = w.requests + " waiting";
        const why = document.createElement("div");
        why.className = "why";
        const short = Object.entries(w.short || {}).map(([d, n]) => d + " short by " + fmt(n)).join(", ");
        why.textContent = (w.why || "") + (short ? ": " + short : "");
        q.appendChild(why);
      }
      cell(tr, q, "queue");
      const idle = m.ttl_left != null ? "unloads in " + m.ttl_left + " s" : m.idle_seconds != null && stateOf(m) === "loaded"
        ? "idle " + Math.round(m.idle_seconds) + " s" : "";
      cell(tr, idle, "num");
      const kept = mem.kept || {};
      cell(tr, kept.files ? kept.files + " · " + fmt((kept.ram || 0) + (kept.disk || 0)) : "", "num");
      cell(tr, fitText(mem.fit), "fit");
      const actions = cell(tr, "", "actions");
      const st0 = stateOf(m);
      actions.append(button("Load", "load", m.id, !(st0 === "unloaded" || st0 === "failed")),
                     button("Unload", "unload", m.id, !(st0 === "loaded" || st0 === "loading")));
      body.appendChild(tr);
    }
  }

  // a load under way: llama.cpp's progress as its engine reports it ({stages, current, value})
  function showProgress(cellDiv, p) {
    let bar = cellDiv.querySelector(".progress");
    if (!bar) {
      bar = document.createElement("div");
      bar.className = "progress";
      cellDiv.appendChild(bar);
    }
    const pct = Math.max(0, Math.min(100, Math.round((p.value || 0) * 100)));
    bar.dataset.progress = String(pct);
    bar.textContent = pct + "%" + (p.current ? " " + String(p.current).replace(/_/g, " ") : "");
    bar.style.setProperty("--pct", pct + "%");
  }

  function fitText(fit) {
    if (!fit) return "";
    const parts = [];
    const layers = Object.entries(fit.layers || {}).map(([d, n]) => d + " " + n).join(", ");
    if (layers) parts.push("layers " + layers);
    if (fit.experts_on_host) parts.push("experts of " + fit.experts_on_host + " layers on the host");
    if (fit.to_host && fit.to_host.length) parts.push(fit.to_host.join(", ") + " on the host");
    if (fit.n_ctx) parts.push("context " + fit.n_ctx);
    return parts.join("; ");
  }

  function button(text, action, model, disabled) {
    const b = document.createElement("button");
    b.type = "button";
    b.textContent = text;
    b.dataset.action = action;
    b.disabled = disabled;
    b.addEventListener("click", () => control(action, model, b));
    return b;
  }

  async function control(action, model, b) {
    b.disabled = true;
    try {
      const res = await api("/models/" + action, { method: "POST", headers: { "Content-Type": "application/json" },
                                                   body: JSON.stringify({ model }) });
      if (!res.ok) addEvent(Date.now(), "failed", model, action + ": " + (await errorText(res)));
    } catch (e) {
      if (!(e instanceof AuthError)) addEvent(Date.now(), "failed", model, action + ": " + e.message);
    }
    refresh();
  }

  function renderModelPicker() {
    const sel = $("chat-model");
    const names = [];
    for (const m of view.models) {
      names.push([m.id, m.id]);
      for (const a of m.aliases || []) names.push([a, a + " → " + m.id]);
    }
    const key = names.map((n) => n[0]).join("\n");
    if (sel.dataset.names === key) return;
    const current = sel.value;
    sel.textContent = "";
    for (const [value, label] of names) {
      const o = document.createElement("option");
      o.value = value;
      o.textContent = label;
      sel.appendChild(o);
    }
    sel.dataset.names = key;
    if (names.some((n) => n[0] === current)) sel.value = current;
  }

  async function refresh() {
    try {
      const res = await api("/models");
      if (!res.ok) throw new Error(await errorText(res));
      const j = await res.json();
      view.models = j.data;
      view.devices = j.devices || {};
      $("auth").hidden = true;
      renderDevices();
      renderModels();
      renderModelPicker();
      document.body.dataset.ready = "1";
    } catch (e) {
      if (!(e instanceof AuthError)) setLive(false, e.message);
    }
  }

  function refreshSoon() {
    if (view.timer) return;
    view.timer = setTimeout(() => {
      view.timer = null;
      refresh();
    }, 120);
  }

  // -- events ---------------------------------------------------------------------
  const STATUS = { "load-start": "loading", load: "loaded", unloaded: "unloaded", "load-failed": "failed",
                   "worker-died": "unloaded" };

  function describe(ev) {
    const d = ev.data || {};
    if (ev.event === "status_change") {
      const kind = d.exit_code === 1 ? "failed" : d.status;
      const devs = Array.isArray(d.devices) ? d.devices.join(", ") : d.devices;  // "GPU0+GPU1" or a list
      const where = devs ? " on " + devs : "";
      return [kind, kind + where + (d.reason ? ": " + d.reason : "")];
    }
    if (ev.event === "evicted") {
      const devs = Object.keys(d.short && Object.keys(d.short).length ? d.short : d.bytes || {});
      const freed = devs.map((x) => fmt((d.bytes || {})[x] || 0) + " on " + x).join(", ");
      return ["evicted", "evicted from " + devs.join(", ") + " for " + d.newcomer + " (" + freed + ")"];
    }
    if (ev.event === "waiting") {
      const short = Object.entries(d.short || {}).map(([x, n]) => x + " short by " + fmt(n)).join(", ");
      return ["waiting", "waits: " + (d.why || "") + (short ? " (" + short + ")" : "")];
    }
    if (ev.event.startsWith("worker-")) {
      const what = ev.event.slice(7);
      return ["worker", "worker " + what + " on " + d.devices + (d.pid ? " (pid " + d.pid + ")" : "") +
                        (d.reason ? ": " + d.reason : "")];
    }
    const rest = Object.assign({}, d);
    delete rest.devices;
    const where = d.devices ? " on " + d.devices : "";
    return [ev.event, ev.event + where + (Object.keys(rest).length ? " " + JSON.stringify(rest) : "")];
  }

  function addEvent(when, kind, model, text) {
    const list = $("events");
    const li = document.createElement("li");
    li.className = kind;
    li.dataset.event = kind;
    li.dataset.model = model || "";
    const t = document.createElement("span");
    t.className = "t";
    t.textContent = new Date(when).toLocaleTimeString();
    const k = document.createElement("span");
    k.className = "kind";
    k.textContent = model || "";
    li.append(t, k, text);
    list.insertBefore(li, list.firstChild);
    while (list.children.length > 300) list.removeChild(list.lastChild);
  }

  // the end of an eviction or an unload: its status_change says it already
  const QUIET = new Set(["evict", "unload", "download_progress"]);

  function onEvent(ev) {
    const d = ev.data || {};
    if (ev.event === "status_change" && d.status === "loading" && d.progress) {  // a tick of a load
      view.progress[ev.model] = d.progress;
      const row = document.querySelector(`#models tr[data-model='${CSS.escape(ev.model)}'] .state-cell div`);
      if (row) showProgress(row, d.progress);
      return;
    }
    if (ev.event === "status_change" && d.status !== "loading") delete view.progress[ev.model];
    if (QUIET.has(ev.event)) return refreshSoon();
    const [kind, text] = describe(ev);
    addEvent(Date.now(), kind, ev.model, text);
    refreshSoon();
  }

  async function history() {
    try {
      const res = await api("/events");
      if (!res.ok) return;
      const j = await res.json();
      const now = Date.now(), last = j.data.length ? j.data[j.data.length - 1].t : 0;
      for (const e of j.data) {
        if (QUIET.has(e.event)) continue;
        const ev = STATUS[e.event]
          ? { model: e.model, event: "status_change",
              data: { status: STATUS[e.event], devices: e.devices, exit_code: e.event === "load-failed" ? 1 : 0,
                      reason: (e.data || {}).reason } }
          : { model: e.model, event: e.event, data: Object.assign({ devices: e.devices }, e.data || {}) };
        const [kind, text] = describe(ev);
        addEvent(now - (last - e.t) * 1000, kind, e.model, text);
      }
    } catch (e) {
      /* the key: asked by refresh() */
    }
  }

  function setLive(ok, why) {
    const el = $("live");
    el.className = "pill " + (ok ? "live" : "down");
    el.textContent = ok ? "live" : why || "offline";
  }

  async function* sse(res) {
    const reader = res.body.getReader();
    const dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buf += dec.decode(value, { stream: true });
      let i;
      while ((i = buf.indexOf("\n\n")) >= 0) {
        const block = buf.slice(0, i);
        buf = buf.slice(i + 2);
        for (const line of block.split("\n")) if (line.startsWith("data: ")) yield line.slice(6);
      }
    }
  }

  async function listen() {
    for (;;) {
      try {
        const res = await api("/models/sse", { headers: { Accept: "text/event-stream" } });
        if (res.ok) {
          setLive(true);
          refresh();
          for await (const data of sse(res)) {
            try {
              onEvent(JSON.parse(data));
            } catch (e) {
              console.warn("event not shown", data, e);  // one odd event never ends the stream
            }
          }
        }
        setLive(false, "reconnecting");
      } catch (e) {
        if (e instanceof AuthError) {
          await keyGiven();
          continue;
        }
        setLive(false, "reconnecting");
      }
      await sleep(2000);
    }
  }

  // -- chat -----------------------------------------------------------------------
  const chat = { messages: [], abort: null };

  function addMessage(who, text) {
    const div = document.createElement("div");
    div.className = "msg " + (who === "you" ? "user" : "assistant");
    const w = document.createElement("span");
    w.className = "who";
    w.textContent = who;
    const reasoning = document.createElement("div");
    reasoning.className = "reasoning";
    const answer = document.createElement("div");
    answer.className = "answer";
    answer.textContent = text;
    div.append(w, reasoning, answer);
    $("chat-log").appendChild(div);
    return { reasoning, answer };
  }

  function chatStatus(text) {
    $("chat-status").textContent = text;
  }

  async function send(text) {
    const model = $("chat-model").value;
    if (!model || !text.trim()) return;
    chat.messages.push({ role: "user", content: text });
    addMessage("you", text);
    const out = addMessage(model, "");
    const ctrl = new AbortController();
    chat.abort = ctrl;
    $("chat-stop").disabled = false;
    $("chat-send").disabled = true;
    chatStatus("waiting for " + model + "…");
    let content = "", thought = "", chunks = 0, painted = false, how = "done";
    const paint = () => {
      painted = false;
      out.answer.textContent = content;
      out.reasoning.textContent = thought;
      const log = $("chat-log");
      log.scrollTop = log.scrollHeight;
      out.answer.dataset.chunks = chunks;
      if (chat.abort) chatStatus("streaming from " + model + ": " + chunks + " chunks");
    };
    try {
      const res = await api("/v1/chat/completions", {
        method: "POST", headers: { "Content-Type": "application/json" }, signal: ctrl.signal,
        body: JSON.stringify({ model, messages: chat.messages, stream: true }),
      });
      if (!res.ok) throw new Error(await errorText(res));
      for await (const data of sse(res)) {
        if (data === "[DONE]") break;
        const j = JSON.parse(data);
        if (j.error) throw new Error(j.error.message || JSON.stringify(j.error));
        const delta = (j.choices && j.choices[0] && j.choices[0].delta) || {};
        if (delta.reasoning_content) thought += delta.reasoning_content;
        if (delta.content) content += delta.content;
        chunks++;
        if (!painted) {
          painted = true;
          requestAnimationFrame(paint);
        }
      }
    } catch (e) {
      how = e.name === "AbortError" ? "stopped" : e instanceof AuthError ? "API key needed" : "error: " + e.message;
    }
    paint();
    chat.messages.push({ role: "assistant", content });
    chat.abort = null;
    $("chat-stop").disabled = true;
    $("chat-send").disabled = false;
    $("chat-status").dataset.state = how === "done" ? "done" : how === "stopped" ? "stopped" : "error";
    chatStatus(how === "done" ? "done: " + chunks + " chunks" : how === "stopped" ? "stopped after " + chunks + " chunks" : how);
  }

  // -- wiring -----------------------------------------------------------------------
  function theme(t) {
    document.documentElement.dataset.theme = t;
    localStorage.setItem(THEME, t);
    if (Object.keys(view.devices).length) renderDevices();
  }

  document.addEventListener("DOMContentLoaded", () => {
    const dark = window.matchMedia && window.matchMedia("(prefers-color-scheme: dark)").matches;
    document.documentElement.dataset.theme = localStorage.getItem(THEME) || (dark ? "dark" : "light");
    $("theme").addEventListener("click", () => theme(document.documentElement.dataset.theme === "dark" ? "light" : "dark"));
    $("key-button").addEventListener("click", () => {
      $("auth-msg").textContent = "The API key this browser sends (empty: none).";
      $("auth").hidden = !$("auth").hidden;
    });
    $("auth-form").addEventListener("submit", (e) => {
      e.preventDefault();
      const key = $("auth-key").value.trim();
      if (key) localStorage.setItem(KEY, key);
      else localStorage.removeItem(KEY);
      $("auth-key").value = "";
      $("auth").hidden = true;
      view.keyWaiters.splice(0).forEach((r) => r());
      refresh();
      if (!$("events").children.length) history();
    });
    $("chat-input").addEventListener("submit", (e) => {
      e.preventDefault();
      const text = $("chat-text").value;
      $("chat-text").value = "";
      send(text);
    });
    $("chat-text").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey) {
        e.preventDefault();
        $("chat-input").requestSubmit();
      }
    });
    $("chat-stop").addEventListener("click", () => chat.abort && chat.abort.abort());
    $("chat-new").addEventListener("click", () => {
      chat.messages = [];
      $("chat-log").textContent = "";
      chatStatus("");
    });
    history();
    refresh();
    listen();
  });
})();
