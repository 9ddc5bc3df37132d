// SPDX-License-Identifier: AGPL-3.0-only
// The OpenDsec console: plain JavaScript over the REST API, with the API key the user
// typed (kept in this page's memory only). Everything a server sends is shown as text
// (textContent), never parsed as HTML.
"use strict";
(() => {
  const $ = (s) => document.querySelector(s);
  // The key lives in this page's memory only: not in storage that a window opened from
  // here, or another page of this origin (a sandbox's port is served on it), could read.
  // A reload asks for it again.
  let key = "";
  // What the current view must stop when another one opens (timers, streams, terminals).
  let cleanups = [];

  function el(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "text") e.textContent = v;
      else if (k === "class") e.className = v;
      else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
      else if (v !== undefined && v !== null) e.setAttribute(k, v);
    }
    for (const c of children.flat()) {
      if (c === null || c === undefined) continue;
      e.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return e;
  }

  function status(msg) { $("#status").textContent = msg || ""; }

  class ApiError extends Error {
    constructor(status, code, message) { super(`${code}: ${message}`); this.status = status; this.code = code; }
  }

  async function api(method, path, body, opts = {}) {
    const headers = { Authorization: `Bearer ${key}` };
    let payload;
    if (body instanceof Uint8Array) { headers["Content-Type"] = "application/octet-stream"; payload = body; }
    else if (body !== undefined) { headers["Content-Type"] = "application/json"; payload = JSON.stringify(body); }
    const r = await fetch(path, { method, headers, body: payload, signal: opts.signal });
    if (!r.ok) {
      let code = "http_error", message = `HTTP ${r.status}`;
      try { const j = await r.json(); code = j.code || code; message = j.message || message; } catch (_) { /* not JSON */ }
      throw new ApiError(r.status, code, message);
    }
    if (opts.raw) return r;
    const t = await r.text();
    return t ? JSON.parse(t) : null;
  }

  async function* ndjson(resp) {
    const reader = resp.body.getReader();
    const dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += dec.decode(value, { stream: true });
      let i;
      while ((i = buf.indexOf("\n")) >= 0) {
        const line = buf.slice(0, i).trim();
        buf = buf.slice(i + 1);
        if (line) yield JSON.parse(line);
      }
    }
    if (buf.trim()) yield JSON.parse(buf);
  }

  function bytesOf(b64) {
    const bin = atob(b64 || "");
    const a = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i++) a[i] = bin.charCodeAt(i);
    return a;
  }

  const q = (params) => new URLSearchParams(params).toString();
  const mib = (b) => `${(b / 1048576).toFixed(1)} MiB`;
  const when = (ms) => (ms ? new Date(ms).toLocaleString() : "");
  function inSecs(ms) {
    const s = Math.round((ms - Date.now()) / 1000);
    if (s <= 0) return "now";
    return s < 120 ? `${s} s` : s < 7200 ? `${Math.round(s / 60)} min` : `${Math.round(s / 3600)} h`;
  }
  const labels = (m) => Object.entries(m || {}).map(([k, v]) => el("span", { class: "label", text: `${k}=${v}` }));
  const compact = (o) => Object.entries(o || {}).map(([k, v]) => `${k}: ${v}`).join(", ");

  function table(headers, rows, onclick) {
    return el("table", {},
      el("thead", {}, el("tr", {}, headers.map((h) => el("th", { text: h })))),
      el("tbody", {}, rows.map((r, i) => {
        const tr = el("tr", onclick ? { class: "clickable", onclick: () => onclick(i) } : {},
          r.cells.map((c) => (c instanceof Node ? el("td", {}, c) : el("td", { text: c ?? "" }))));
        if (r.id) tr.dataset.id = r.id;
        return tr;
      })));
  }

  function every(ms, f) {
    let stop = false;
    const tick = async () => {
      if (stop) return;
      try { await f(); status(""); } catch (e) { status(e.message); }
      if (!stop) t = setTimeout(tick, ms);
    };
    let t = setTimeout(tick, 0);
    cleanups.push(() => { stop = true; clearTimeout(t); });
  }

  function view(...children) {
    const main = $("#main-view");
    main.replaceChildren(...children);
    return main;
  }

  // ---- views ------------------------------------------------------------------------

  function sandboxes() {
    const holder = el("div", {});
    view(el("h1", { text: "Sandboxes" }), holder);
    every(3000, async () => {
      const r = await api("GET", "/v1/sandboxes");
      const list = r.sandboxes.sort((a, b) => b.created_at_ms - a.created_at_ms);
      holder.replaceChildren(list.length === 0 ? el("p", { text: "No sandboxes." }) :
        table(["id", "state", "backend", "image", "cpu", "memory", "project", "labels", "ends in"],
          list.map((s) => ({
            id: s.id,
            cells: [s.id, el("span", { class: `state-${s.state}`, text: s.state + (s.paused_to_disk ? " (disk)" : "") }),
              s.backend, s.image, String(s.limits.cpu_cores), `${s.limits.memory_mb} MiB`, s.project,
              el("span", {}, labels(s.labels)), inSecs(s.expires_at_ms)],
          })),
          (i) => { location.hash = `#/sandbox/${encodeURIComponent(list[i].id)}/terminal`; }));
    });
  }

  async function sandbox(id, tab) {
    const base = `/v1/sandboxes/${encodeURIComponent(id)}`;
    const info = el("p", { class: "mono" });
    const body = el("div", {});
    const act = (verb, method, path, payload) => el("button", {
      text: verb,
      onclick: async () => {
        try { await api(method, base + path, payload); status(`${verb}: done`); if (verb === "Stop") location.hash = "#/sandboxes"; else route(); } catch (e) { status(e.message); }
      },
    });
    const tabs = ["terminal", "files", "processes", "metrics", "trajectories"];
    view(el("h1", { text: id }), info,
      el("div", { class: "actions" }, act("Pause", "POST", "/pause", { to_disk: false }), act("Resume", "POST", "/resume", {}),
        act("Stop", "DELETE", "")),
      el("div", { class: "tabs" }, tabs.map((t) => el("button", {
        text: t, class: t === tab ? "active" : "", "data-tab": t,
        onclick: () => { location.hash = `#/sandbox/${encodeURIComponent(id)}/${t}`; },
      }))),
      body);
    const s = await api("GET", base);
    info.replaceChildren(`${s.state} · ${s.backend} · ${s.image} · ${s.limits.cpu_cores} CPU · ${s.limits.memory_mb} MiB · ${s.project} · ends in ${inSecs(s.expires_at_ms)} `, ...labels(s.labels));
    if (tab === "terminal") await terminal(base, body);
    else if (tab === "files") files(base, body, "/");
    else if (tab === "processes") processes(base, body);
    else if (tab === "metrics") metrics(base, body);
    else if (tab === "trajectories") trajectories(base, body);
  }

  async function terminal(base, body) {
    const box = el("div", { id: "terminal" });
    body.replaceChildren(box);
    const cols = 100, rows = 28;
    const term = new Terminal({
      cols, rows, fontSize: 13, cursorBlink: true,
      // Links a sandbox prints (OSC 8) open elsewhere only: never a page of this origin
      // (a sandbox's port is), and never with a handle back to this window.
      linkHandler: {
        allowNonHttpProtocols: false,
        activate: (_ev, uri) => {
          let u;
          try { u = new URL(uri); } catch (_) { return; }
          if (u.origin === location.origin || !/^https?:$/.test(u.protocol)) { status(`link not opened: ${uri}`); return; }
          window.open(u.href, "_blank", "noopener,noreferrer");
        },
      },
    });
    term.open(box);
    term.focus();
    const ctl = new AbortController();
    let pid = null;
    let sending = Promise.resolve();
    cleanups.push(() => {
      ctl.abort();
      term.dispose();
      if (pid !== null) api("POST", `${base}/processes/${pid}/signal`, { signal: "SIGHUP" }).catch(() => {});
    });
    term.onData((d) => {
      if (pid === null) return;
      const bytes = new TextEncoder().encode(d);
      // One write at a time, so keystrokes arrive in order.
      sending = sending.then(() => api("POST", `${base}/processes/${pid}/stdin`, bytes)).catch((e) => status(e.message));
    });
    try {
      const resp = await api("POST", `${base}/exec`, {
        argv: ["/bin/sh", "-c", "if command -v bash >/dev/null 2>&1; then exec bash -i; else exec sh -i; fi"],
        env: { TERM: "xterm-256color" }, stream: true, pty: { cols, rows }, tag: "console",
      }, { raw: true, signal: ctl.signal });
      for await (const ev of ndjson(resp)) {
        if (ev.type === "start") { pid = ev.pid; box.dataset.pid = pid; }
        else if (ev.type === "stdout" || ev.type === "stderr") term.write(bytesOf(ev.data));
        else if (ev.type === "exit") { pid = null; term.write(`\r\n[exited ${ev.exit_code}]\r\n`); break; }
        else if (ev.type === "error") { term.write(`\r\n[${ev.code}: ${ev.message}]\r\n`); break; }
      }
    } catch (e) {
      if (e.name !== "AbortError") status(e.message);
    }
  }

  async function files(base, body, path) {
    const download = async (f) => {
      try {
        const r = await api("GET", `${base}/files?${q({ path: f.path })}`, undefined, { raw: true });
        const a = el("a", { href: URL.createObjectURL(await r.blob()), download: f.name });
        a.click();
        setTimeout(() => URL.revokeObjectURL(a.href), 10000);
      } catch (e) { status(e.message); }
    };
    const up = path === "/" ? null : path.replace(/\/[^/]*$/, "") || "/";
    try {
      const r = await api("GET", `${base}/files/list?${q({ path, depth: 1 })}`);
      const list = r.entries;
      body.replaceChildren(el("p", { class: "mono", id: "cwd", text: path }),
        up ? el("button", { text: "↑ up", onclick: () => files(base, body, up) }) : "",
        table(["name", "type", "size", "mode", "modified"], list.map((f) => ({
          id: f.path, cells: [f.name, f.type, f.type === "file" ? String(f.size) : "", f.mode.toString(8), when(f.mtime_ms)],
        })), (i) => (list[i].type === "dir" ? files(base, body, list[i].path) : download(list[i]))));
    } catch (e) { body.replaceChildren(el("p", { class: "error", text: e.message })); }
  }

  function processes(base, body) {
    const out = el("pre", { class: "box" });
    const holder = el("div", {});
    body.replaceChildren(holder, out);
    let ctl = null;
    cleanups.push(() => ctl && ctl.abort());
    const show = async (p) => {
      if (ctl) ctl.abort();
      ctl = new AbortController();
      out.textContent = "";
      try {
        const r = await api("GET", `${base}/processes/${p.pid}/output`, undefined, { raw: true, signal: ctl.signal });
        const dec = new TextDecoder();
        for await (const ev of ndjson(r)) {
          if (ev.type === "stdout" || ev.type === "stderr") out.textContent += dec.decode(bytesOf(ev.data), { stream: true });
          else if (ev.type === "exit") { out.textContent += `\n[exited ${ev.exit_code}]`; break; }
        }
      } catch (e) { if (e.name !== "AbortError") status(e.message); }
    };
    every(3000, async () => {
      const r = await api("GET", `${base}/processes`);
      const list = r.processes;
      holder.replaceChildren(table(["pid", "command", "tag", "running", "exit", "started"], list.map((p) => ({
        id: String(p.pid), cells: [String(p.pid), p.argv.join(" "), p.tag || "", p.running ? "yes" : "no", p.exit_code ?? "", when(p.started_at_ms)],
      })), (i) => show(list[i])));
    });
  }

  function metrics(base, body) {
    let last = null;
    body.replaceChildren(el("p", { text: "Reading…" }));
    every(2000, async () => {
      const m = await api("GET", `${base}/metrics`);
      let cpu = "";
      if (last) {
        const dt = (m.timestamp_ms - last.timestamp_ms) * 1e6;
        if (dt > 0) cpu = `${(100 * (m.cpu_used_ns - last.cpu_used_ns) / dt).toFixed(1)} % of a core`;
      }
      last = m;
      const frac = m.memory_limit_bytes ? m.memory_used_bytes / m.memory_limit_bytes : 0;
      body.replaceChildren(table(["", ""], [
        { cells: ["CPU", cpu || "…"] },
        { cells: ["CPU limit", `${m.cpu_cores} cores`] },
        { cells: ["memory", el("span", {}, el("span", { class: "bar-bg" }, el("span", { class: "bar", style: `width:${Math.min(100, 100 * frac).toFixed(1)}%` })), ` ${mib(m.memory_used_bytes)} of ${mib(m.memory_limit_bytes)}`)] },
        { cells: ["disk", m.disk_total_bytes ? `${mib(m.disk_used_bytes)} of ${mib(m.disk_total_bytes)}` : ""] },
      ]));
    });
  }

  async function trajectories(base, body) {
    const out = el("pre", { class: "box" });
    try {
      const r = await api("GET", `${base}/trajectories`);
      const list = r.trajectories || [];
      body.replaceChildren(list.length ? table(["name", "steps"], list.map((t) => ({ cells: [t.name, String(t.steps ?? "")] })),
        async (i) => {
          try { out.textContent = JSON.stringify(await api("GET", `${base}/trajectories/${encodeURIComponent(list[i].name)}`), null, 2); } catch (e) { status(e.message); }
        }) : el("p", { text: "No trajectory logs." }), out);
    } catch (e) { body.replaceChildren(el("p", { class: "error", text: e.message })); }
  }

  async function images() {
    const r = await api("GET", "/v1/images");
    const list = r.images || [];
    view(el("h1", { text: "Images" }), table(["image", "digest", "size", "project"], list.map((i) => ({
      cells: [i.reference || i.image || i.name || "", (i.digest || "").slice(0, 19), i.size_bytes ? mib(i.size_bytes) : "", i.project || ""],
    }))));
  }

  async function projects() {
    const r = await api("GET", "/v1/projects");
    view(el("h1", { text: "Projects, quotas and usage" }), table(["project", "quota", "usage"],
      (r.projects || []).map((p) => ({ cells: [p.path, compact(p.quota), compact(p.usage)] }))));
  }

  function events() {
    const holder = el("div", {});
    view(el("h1", { text: "Events" }), holder);
    const seen = [];
    let after = 0;
    let stop = false;
    const ctl = new AbortController();
    cleanups.push(() => { stop = true; ctl.abort(); });
    const draw = () => holder.replaceChildren(seen.length === 0 ? el("p", { text: "No events yet." }) :
      table(["time", "type", "sandbox", "reason", "project"], seen.slice().reverse().map((e) => ({
        id: e.id, cells: [when(e.at_ms), e.type, e.sandbox, e.reason || "", e.project],
      }))));
    (async () => {
      let wait = 0;
      while (!stop) {
        try {
          const r = await api("GET", `/v1/events?${q({ after, limit: 1000, wait_seconds: wait })}`, undefined, { signal: ctl.signal });
          seen.push(...r.events);
          if (seen.length > 2000) seen.splice(0, seen.length - 2000);
          after = r.next;
          draw();
          wait = r.events.length >= 1000 ? 0 : 25;
        } catch (e) {
          if (e.name === "AbortError") return;
          status(e.message);
          await new Promise((res) => setTimeout(res, 3000));
        }
      }
    })();
  }

  // ---- routing and login ------------------------------------------------------------

  async function route() {
    for (const c of cleanups.splice(0)) { try { c(); } catch (_) { /* already gone */ } }
    status("");
    if (!key) { showLogin(); return; }
    $("#login-view").hidden = true;
    $("#main-view").hidden = false;
    $("#nav").hidden = false;
    $("#logout").hidden = false;
    const parts = (location.hash || "#/sandboxes").slice(2).split("/").map(decodeURIComponent);
    for (const a of document.querySelectorAll("#nav a")) a.classList.toggle("active", a.dataset.view === parts[0] || (parts[0] === "sandbox" && a.dataset.view === "sandboxes"));
    try {
      if (parts[0] === "sandbox" && parts[1]) await sandbox(parts[1], parts[2] || "terminal");
      else if (parts[0] === "images") await images();
      else if (parts[0] === "projects") await projects();
      else if (parts[0] === "events") events();
      else sandboxes();
    } catch (e) {
      if (e.status === 401) { logout(e.message); return; }
      status(e.message);
    }
  }

  function showLogin(msg) {
    $("#nav").hidden = true;
    $("#logout").hidden = true;
    $("#main-view").hidden = true;
    $("#login-view").hidden = false;
    $("#who").textContent = "";
    $("#login-error").textContent = msg || "";
    $("#key").focus();
  }

  function logout(msg) {
    key = "";
    for (const c of cleanups.splice(0)) { try { c(); } catch (_) { /* already gone */ } }
    showLogin(msg);
  }

  $("#login-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    key = $("#key").value.trim();
    try {
      const me = await api("GET", "/v1/whoami");
      $("#key").value = "";
      $("#who").textContent = `${me.principal || ""} · ${me.project || ""}`;
      if (!location.hash) location.hash = "#/sandboxes";
      else route();
    } catch (e) {
      key = "";
      $("#login-error").textContent = e.status === 401 ? "That key is not valid (or was revoked)." : e.message;
    }
  });
  $("#logout").addEventListener("click", () => logout());
  window.addEventListener("hashchange", route);
  route();
})();
