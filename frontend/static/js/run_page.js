// The run page, live: a websocket delivers the backlog (from the last event sequence and metric step
// this page saw) and then every update. On a drop it reconnects with those cursors, so nothing is
// missed or doubled, and the charts keep their zoom and hidden series.
(function () {
  "use strict";
  const run = JSON.parse(document.getElementById("run-data").textContent);
  const $ = (id) => document.getElementById(id);
  const QUIET_KINDS = new Set(["rollout", "eval", "command_acknowledged"]);
  const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);
  const MAX_LOG_LINES = 500;
  const ZOOM_BUCKETS = 600;

  let lastSeq = 0, lastStep = 0, socket = null, attempts = 0, closedByPage = false;

  const grid = new FBCharts.ChartGrid($("charts"), { labels: ["value"], xLabel: "step", onZoom: loadDetail });
  window.FBRunPage = { grid, cursors: () => ({ lastSeq, lastStep }), reconnect: () => socket && socket.close() };

  function setConnection(text, open) {
    $("conn").textContent = text;
    $("conn").className = "conn " + (open ? "conn-open" : "conn-closed");
  }

  function setState(state) {
    const badge = $("run-state");
    badge.textContent = state.charAt(0).toUpperCase() + state.slice(1);
    badge.className = "state state-" + state;
    badge.dataset.state = state;
  }

  function addMetrics(metrics) {
    const keys = Object.keys(metrics).sort();
    keys.forEach((key) => {
      const points = metrics[key];
      if (!points.length) return;
      grid.add(key, points);
      lastStep = Math.max(lastStep, points[points.length - 1][0]);
    });
    if (keys.length) $("charts-empty").hidden = true;
    applyChartFilter();
  }

  const who = (p) => `${p.role || ""}${p.replica != null ? " " + p.replica : ""}`.trim() || "run";

  function describe(event) {
    const p = event.payload || {};
    switch (event.kind) {
      case "state_changed": return `${p.from || "—"} → ${p.to}${p.reason ? ": " + p.reason : ""}`;
      case "fault_injected": return `${p.fault_kind || p.kind || "fault"} on ${who(p)}${p.duration_s ? ` for ${p.duration_s} s` : ""}`;
      case "failure_detected": return `${who(p)}${p.hung ? " hung" : " failed"}${p.time_to_detect_s != null ? ` (detected in ${Number(p.time_to_detect_s).toFixed(2)} s)` : ""}${p.reason ? ": " + p.reason.slice(0, 120) : ""}`;
      case "replica_replaced": return `${who(p)} replaced${p.from_spare ? " by a warm spare" : ""}${p.host ? " on " + p.host : ""}${p.policy_version != null ? `, at policy version ${p.policy_version}` : ""}`;
      case "recovered": return `recovered ${who(p)}${p.time_to_recover_s != null ? ` in ${Number(p.time_to_recover_s).toFixed(2)} s` : ""}`;
      case "placement_changed": return `${p.action || "change"} ${who(p)}${p.host ? " → " + p.host : ""}`;
      case "redirect_started": case "redirect_finished": return `${p.action || "redirect"} host ${p.host || ""}`;
      case "restarted": return `restart ${p.restart || p.count || ""}${p.from_checkpoint ? " from " + p.from_checkpoint : ""}`;
      case "command_issued": return `command ${p.command}: ${p.kind}`;
      case "command_finished": {
        const why = p.result && (p.result.error || p.result.reason);
        return `command ${p.command} (${p.kind}) ${p.ok === false ? "failed" : "done"}${why ? ": " + why : ""}`;
      }
      case "checkpoint_saved": return `checkpoint at step ${p.step}`;
      case "message":
        if (p.name === "child_run_started") return `started ${p.experiment} #${p.number} from step ${p.step}`;
        if (p.name === "child_run_failed") return `no run started from step ${p.step}: ${p.reason}`;
        if (p.name === "job_submitted") return `submitted as ${p.backend} job ${p.job_id}`;
        if (p.text && !p.name) return p.text;
        return JSON.stringify(p).slice(0, 160);
      default: {
        const text = JSON.stringify(p);
        return text.length > 160 ? text.slice(0, 157) + "…" : text;
      }
    }
  }

  function addEvents(events) {
    const list = $("timeline");
    const showAll = $("timeline-all").checked;
    events.forEach((event) => {
      if (event.seq <= lastSeq) return;
      lastSeq = event.seq;
      if (event.kind === "state_changed" && event.payload && event.payload.to) setState(event.payload.to);
      if (event.kind === "checkpoint_saved") document.body.dispatchEvent(new CustomEvent("checkpoint-saved"));
      const item = document.createElement("li");
      item.className = "ev-" + event.kind;
      item.dataset.kind = event.kind;
      item.dataset.seq = event.seq;
      item.hidden = QUIET_KINDS.has(event.kind) && !showAll;
      const time = document.createElement("time");
      time.dateTime = event.time;
      time.textContent = new Date(event.time).toLocaleTimeString();
      const kind = document.createElement("strong");
      kind.textContent = " " + event.kind.replace(/_/g, " ") + " ";
      item.append(time, kind, document.createTextNode(describe(event)));
      list.prepend(item);
    });
  }

  function addLogs(lines) {
    if (!lines || !lines.length) return;
    const pre = $("logs");
    const atBottom = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
    const kept = (pre.textContent ? pre.textContent.split("\n") : []).concat(lines).slice(-MAX_LOG_LINES);
    pre.textContent = kept.join("\n");
    if (atBottom) pre.scrollTop = pre.scrollHeight;
  }

  function onMessage(message) {
    const data = JSON.parse(message.data);
    if (data.type === "pong") return;
    if (data.type === "run.backlog" && data.state) setState(data.state);
    addEvents(data.events || []);
    addMetrics(data.metrics || {});
    addLogs(data.logs);
  }

  function connect() {
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    socket = new WebSocket(`${scheme}://${location.host}${run.wsPath}?after_seq=${lastSeq}&after_step=${lastStep}`);
    socket.onopen = () => { attempts = 0; setConnection("live", true); };
    socket.onmessage = onMessage;
    socket.onclose = (e) => {
      if (closedByPage) return;
      if (e.code === 4401 || e.code === 4404) { setConnection("not allowed to follow this run", false); return; }
      attempts += 1;
      const delay = Math.min(10000, 500 * 2 ** Math.min(attempts, 5));
      setConnection(`reconnecting in ${Math.round(delay / 1000)} s…`, false);
      setTimeout(connect, delay);
    };
  }

  // Zooming in loads that step range at full resolution (the live stream is downsampled).
  async function loadDetail(key, min, max) {
    if (min === null) return;
    const start = Math.max(0, Math.floor(min)), end = Math.ceil(max);
    try {
      const data = await FB.api(`${run.apiPath}metrics/${key.split("/").map(encodeURIComponent).join("/")}` +
        `?start_step=${start}&end_step=${end}&buckets=${ZOOM_BUCKETS}`);
      grid.add(key, data.steps.map((s, i) => [s, data.values[i]]));
    } catch (error) {
      console.warn("could not load detail for", key, error);
    }
  }

  function applyChartFilter() {
    const text = $("chart-filter").value.trim().toLowerCase();
    grid.charts.forEach((chart, key) => { chart.figure.hidden = text !== "" && !key.toLowerCase().includes(text); });
  }

  $("chart-filter").addEventListener("input", applyChartFilter);
  $("smoothing").addEventListener("input", (e) => grid.setSmoothing(Number(e.target.value)));
  $("timeline-all").addEventListener("change", (e) => {
    $("timeline").querySelectorAll("li").forEach((li) => { li.hidden = QUIET_KINDS.has(li.dataset.kind) && !e.target.checked; });
  });

  // Operator controls post to the API (no reload, so charts keep their state); the form is the fallback.
  document.querySelectorAll("form[data-command]").forEach((form) => {
    form.addEventListener("submit", async (e) => {
      if (e.defaultPrevented) return;  // the confirmation was declined
      e.preventDefault();
      const fields = Object.fromEntries(new FormData(form).entries());
      const body = { kind: fields.kind, payload: payloadFromFields(fields) };
      const status = $("command-status");
      try {
        const command = await FB.api(`${run.apiPath}commands`, { method: "POST", body });
        status.textContent = `${command.kind.replace(/_/g, " ")} sent (command ${command.id})`;
        status.className = "";
      } catch (error) {
        const problems = (error.data && error.data.errors) || [];
        status.textContent = problems.length ? problems.map((p) => `${p.field}: ${p.message}`).join("; ") : error.message;
        status.className = "error";
      }
    });
  });

  // Mirrors forgeboard.web.views.runs.form_payload: `payload.a.b` fields, numbers as numbers, empties dropped.
  function payloadFromFields(fields) {
    const payload = {};
    Object.entries(fields).forEach(([name, raw]) => {
      if (!name.startsWith("payload.") || raw === "") return;
      const value = /^-?\d+(\.\d+)?$/.test(raw) ? Number(raw) : raw;
      const path = name.slice("payload.".length).split(".");
      let node = payload;
      path.slice(0, -1).forEach((part) => { node = node[part] = node[part] || {}; });
      node[path[path.length - 1]] = value;
    });
    return payload;
  }

  window.addEventListener("beforeunload", () => { closedByPage = true; if (socket) socket.close(); });
  setState(run.state);
  connect();
})();
