// The run page, live: a websocket delivers the backlog (from the last event sequence, metric step and log line this
// page saw, its events in pages) and then every update; the server fills in updates the channel layer lost. On a drop
// it reconnects with those cursors, so nothing is missed or doubled, and the charts keep their zoom and hidden series.
(function () {
  "use strict";
  const run = JSON.parse(document.getElementById("run-data").textContent);
  const $ = (id) => document.getElementById(id);
  const QUIET_KINDS = new Set(["rollout", "eval", "command_acknowledged"]);
  const TERMINAL = new Set(run.terminalStates);
  const CANCELLABLE = new Set(run.cancelStates), TAKES_COMMANDS = new Set(run.commandStates);
  const MAX_LOG_LINES = 500;
  const ZOOM_BUCKETS = 600;

  let lastSeq = 0, lastStep = 0, socket = null, attempts = 0, closedByPage = false;
  let currentState = run.state, endSeen = TERMINAL.has(run.state);
  let startedAt = run.startedAt ? Date.parse(run.startedAt) : null;
  let finishedAt = run.finishedAt ? Date.parse(run.finishedAt) : null;
  // offset: seconds from the run's start (launching → running) to the engine's first startup phase, when the
  // engine was spawned before it could report (a local run: its Python and torch imports).
  const startup = { phases: [], done: false, total: null, offset: 0, metricsSeen: false };
  const ENGINE_PROCESS = "engine_process";

  const grid = new FBCharts.ChartGrid($("charts"), { labels: ["value"], xLabel: "step", onZoom: loadDetail,
    first: Object.keys(FBCharts.HEADLINES), notes: FBCharts.HEADLINES });
  // "Where the time goes": the step timelines of the backlog and of each update; more steps from the API on demand.
  const stepTimeline = new FBTimeline.Timeline($("step-timeline"), {
    load: (last) => FB.api(`${run.apiPath}timeline?last=${last}`) });
  window.FBRunPage = { grid, timeline: stepTimeline, cursors: () => ({ lastSeq, lastStep, lastBatch, lastLine }),
    reconnect: () => socket && socket.close() };

  function setConnection(text, open) {
    $("conn").textContent = text;
    $("conn").className = "conn " + (open ? "conn-open" : "conn-closed");
  }

  function setState(state) {
    const badge = $("run-state");
    badge.textContent = state.charAt(0).toUpperCase() + state.slice(1);
    badge.className = "state state-" + state;
    badge.dataset.state = state;
    currentState = state;
    $("exit-reason-label").textContent = `${run.reasonLabels[state] || "Exit reason"}:`;
    updateLaunchFlash(state);
    showActions(state);
    showStep();
    if (TERMINAL.has(state) && !endSeen) {  // the checkpoints table, as the run left it
      endSeen = true;
      document.body.dispatchEvent(new CustomEvent("run-ended"));
    }
  }

  // The actions a person may take follow the run's state, as the page would render them fresh: cancel while it
  // moves the run on, the operator controls while the run takes commands (else a note says why), neither once
  // the run has ended.
  function showActions(state) {
    const cancel = $("cancel-run"), controls = $("controls");
    if (cancel) cancel.hidden = !CANCELLABLE.has(state);
    if (!controls) return;  // a viewer's page, or a run that had ended when the page was rendered
    controls.hidden = TERMINAL.has(state);
    $("controls-forms").hidden = !TAKES_COMMANDS.has(state);
    $("controls-note").hidden = TAKES_COMMANDS.has(state);
    $("controls-note").textContent = run.controlsNotes[state] || "";
  }

  function showExitReason(reason) {
    if (typeof reason !== "string" || reason === "") return;
    $("exit-reason-text").textContent = reason;
    $("exit-reason").hidden = false;
  }

  // The launch page's "Launched … #N: queued." flash follows the run's state instead of going stale.
  const launchFlashes = Array.from(document.querySelectorAll(".messages li"))
    .filter((li) => li.textContent.trim().endsWith(`#${run.number}: queued.`));
  function updateLaunchFlash(state) {
    launchFlashes.forEach((li) => { li.textContent = li.textContent.replace(/: [a-z]+\.\s*$/, `: ${state}.`); });
  }

  const { number, seconds } = FBEventText;

  // Mirrors the template filter `duration`: 1h 02m, 3m 05s, 12s.
  function formatDuration(total) {
    const t = Math.max(0, Math.floor(total));
    const h = Math.floor(t / 3600), m = Math.floor((t % 3600) / 60), sec = t % 60;
    if (h) return `${h}h ${String(m).padStart(2, "0")}m`;
    return m ? `${m}m ${String(sec).padStart(2, "0")}s` : `${sec}s`;
  }

  // Runs from started_at until the end state (as the server computes it), ticking while the run goes on.
  function showDuration() {
    if (startedAt === null) return;
    $("run-duration").textContent = formatDuration(((finishedAt !== null ? finishedAt : Date.now()) - startedAt) / 1000);
  }

  function followStateTimes(event) {
    const p = event.payload || {}, time = Date.parse(event.time);
    if (isNaN(time)) return;
    if (p.from === "launching" && p.to === "running") {
      startedAt = time; finishedAt = null;
      if (!startup.phases.length && !startup.metricsSeen) {  // the engine has said nothing yet: its process is starting
        startup.phases.push({ phase: ENGINE_PROCESS, label: "spawning the engine", elapsed: 0, at: time,
          duration: null });
        renderStartup();
      }
    }
    if (TERMINAL.has(p.to)) finishedAt = time;
  }

  // Startup: the engine's startup_phase events as a list with each phase's duration and a live counter on
  // the current one; one line ("Started in 12.4 s (…)") once the run is ready or its first metric arrives.
  function addStartupPhase(event) {
    const p = event.payload, elapsed = number(p.elapsed_s) ?? 0, previousS = number(p.previous_s);
    const phase = String(p.phase || "");
    const last = startup.phases[startup.phases.length - 1];
    if ((startup.done && phase !== "ready") || (last && elapsed < last.elapsed)) {  // a restart starts again
      startup.phases = []; startup.done = false; startup.total = null; startup.offset = 0;
    }
    const current = startup.phases[startup.phases.length - 1];
    if (current && current.phase === ENGINE_PROCESS && current.duration === null) {
      current.duration = Math.max(0, ((Date.parse(event.time) || Date.now()) - current.at) / 1000);
      startup.offset = current.duration;
    } else if (current && current.duration === null) {
      current.duration = previousS ?? Math.max(0, elapsed - current.elapsed);
      current.parts = startupParts(p.previous_parts);
    }
    if (phase === "ready") {
      startup.done = true;
      startup.total = startup.offset + elapsed;
    } else {
      startup.phases.push({ phase, label: String(p.label || phase.replace(/_/g, " ")), elapsed,
        at: Date.parse(event.time) || Date.now(), duration: null });
    }
    renderStartup();
    showStep();
  }

  // The parts of a phase that ran side by side (each role's procs loading): [name, seconds into the phase], slowest
  // first; anything that is not a name with a number of seconds is left out.
  function startupParts(raw) {
    if (!raw || typeof raw !== "object" || Array.isArray(raw)) return [];
    return Object.entries(raw).map(([name, value]) => [String(name).slice(0, 40), number(value)])
      .filter(([, value]) => value !== null && value >= 0).sort((a, b) => b[1] - a[1]).slice(0, 12);
  }

  function startupFinishedByMetrics() {
    startup.metricsSeen = true;
    if (startup.phases.length === 1 && startup.phases[0].phase === ENGINE_PROCESS) startup.phases = [];  // an engine that tells no phases
    if (!startup.phases.length || startup.done) { renderStartup(); return; }
    startup.done = true;
    renderStartup();
  }

  function renderStartup() {
    const panel = $("startup"), list = $("startup-phases"), summary = $("startup-summary");
    if (!startup.phases.length) { panel.hidden = true; return; }
    panel.hidden = false;
    const current = startup.phases[startup.phases.length - 1];
    const parts = startup.phases.map((ph) => (ph.duration === null ? ph.label : `${ph.label} ${seconds(ph.duration)}`));
    if (startup.done) {
      panel.open = false;
      panel.dataset.state = "started";
      summary.textContent = startup.total !== null ? `Started in ${seconds(startup.total)} (${parts.join(", ")})`
        : `Started (${parts.join(", ")})`;
    } else {
      const end = TERMINAL.has(currentState) ? (finishedAt ?? Date.now()) : Date.now();
      const running = Math.max(0, (end - current.at) / 1000);
      panel.dataset.state = TERMINAL.has(currentState) ? "stopped" : "starting";
      summary.textContent = TERMINAL.has(currentState)
        ? `Stopped while ${current.label}, after ${seconds(startup.offset + current.elapsed + running)}`
        : `Starting: ${current.label}… ${seconds(running)}`;
    }
    list.replaceChildren(...startup.phases.map((ph) => {
      const item = document.createElement("li");
      item.dataset.phase = ph.phase;
      const pending = ph.duration === null && !startup.done;
      item.className = pending ? "phase-current" : "phase-done";
      const time = pending ? Math.max(0, ((TERMINAL.has(currentState) ? (finishedAt ?? Date.now()) : Date.now()) - ph.at) / 1000)
        : ph.duration;
      item.textContent = time === null ? ph.label : `${ph.label}: ${seconds(time)}${pending ? "…" : ""}`;
      if (ph.parts && ph.parts.length) {
        const parts = document.createElement("span");
        parts.className = "phase-parts";
        parts.textContent = "ready after " + ph.parts.map(([name, value]) => `${name} ${seconds(value)}`).join(" · ");
        item.append(parts);
      }
      return item;
    }));
  }

  // "Step 40 of 200", and while the run runs past its startup the step under way, so a long first step (a big
  // batch) does not look like a stalled run.
  function showStep() {
    const seen = startup.metricsSeen;
    const reported = seen ? `${lastStep} of ${run.totalSteps}` : `— of ${run.totalSteps}`;
    const working = currentState === "running" && (startup.done || seen) && lastStep < run.totalSteps;
    $("run-step").textContent = working ? `${reported} · step ${lastStep + 1} running` : reported;
  }

  function tick() {
    if (startedAt !== null && finishedAt === null) showDuration();
    if (startup.phases.length && !startup.done) renderStartup();
  }

  function addMetrics(metrics) {
    const keys = Object.keys(metrics).sort();
    keys.forEach((key) => {
      const points = metrics[key];
      if (!points.length) return;
      grid.add(key, points);
      lastStep = Math.max(lastStep, points[points.length - 1][0]);
    });
    if (keys.length) { $("charts-empty").hidden = true; startupFinishedByMetrics(); }
    showStep();
    applyChartFilter();
  }

  // The checkpoints table reloads (htmx, on "checkpoints-changed") when a checkpoint is saved or an export moves on:
  // at once, then at most every 2 s while more come, and once after the last (a fast run saves many a second).
  let checkpointsReload = null;
  let checkpointsChangedSince = false;
  function checkpointsChanged() {
    if (checkpointsReload !== null) { checkpointsChangedSince = true; return; }
    document.body.dispatchEvent(new CustomEvent("checkpoints-changed"));
    checkpointsReload = setTimeout(() => {
      checkpointsReload = null;
      if (checkpointsChangedSince) { checkpointsChangedSince = false; checkpointsChanged(); }
    }, 2000);
  }

  function addEvents(events) {
    const list = $("timeline");
    const showAll = $("timeline-all").checked;
    events.forEach((event) => {
      if (event.seq <= lastSeq) return;
      lastSeq = event.seq;
      if (event.kind === "state_changed" && event.payload && event.payload.to) {
        followStateTimes(event);
        setState(event.payload.to);
        showExitReason(event.payload.reason);
        showDuration();
      }
      const isStartup = event.kind === "message" && event.payload && event.payload.name === "startup_phase";
      if (isStartup) addStartupPhase(event);
      const isExport = event.kind === "message" && event.payload && event.payload.name === "checkpoint_export";
      if (event.kind === "checkpoint_saved" || isExport) checkpointsChanged();
      if (event.kind.startsWith("command_")) followCommand(event);
      const item = document.createElement("li");
      item.className = "ev-" + event.kind;
      item.dataset.kind = event.kind;
      item.dataset.seq = event.seq;
      item.hidden = QUIET_KINDS.has(event.kind) && !showAll;
      const time = document.createElement("time");
      time.dateTime = event.time;
      time.textContent = new Date(event.time).toLocaleTimeString();
      const kind = document.createElement("strong");
      kind.textContent = " " + (isStartup ? "startup" : event.kind.replace(/_/g, " ")) + " ";
      item.append(time, kind, document.createTextNode(FBEventText.describe(event)));
      list.prepend(item);
    });
  }

  // The commands table follows the command events: a new command's row on top, its state and result in place as
  // the engine acknowledges and finishes it. The backlog replays the run's whole history: a command older than the
  // newest row is not added, and a row's state never goes back. A command expires when its run ends or is lost
  // (a command_finished event with the state "expired"); a result its controller reports later still comes after.
  const COMMAND_PROGRESS = { pending: 0, delivered: 1, expired: 2, succeeded: 3, failed: 3 };

  function followCommand(event) {
    const p = event.payload || {}, id = p.command;
    if (!Number.isInteger(id)) return;
    const body = $("commands").tBodies[0];
    const rows = Array.from(body.querySelectorAll("tr[data-command]"));
    const row = rows.find((r) => Number(r.dataset.command) === id);
    if (event.kind === "command_issued" && !row && !(rows.length && id < Number(rows[0].dataset.command))) {
      body.prepend(commandRow(id, p));
      const empty = $("commands-empty");
      if (empty) empty.remove();
      rows.slice(run.commandsShown - 1).forEach((old) => old.remove());
    } else if (row && event.kind === "command_acknowledged") {
      advanceCommand(row, "delivered");
    } else if (row && event.kind === "command_finished" &&
               advanceCommand(row, p.state === "expired" ? "expired" : p.ok === false ? "failed" : "succeeded")) {
      row.querySelector('[data-field="result"] code').textContent = commandJson(p.result, true);
    }
  }

  function commandRow(id, p) {
    const row = document.createElement("tr");
    row.dataset.command = id;
    row.dataset.state = "pending";
    const cell = (text, { field = null, className = "", code = false } = {}) => {
      const td = document.createElement("td");
      if (field) td.dataset.field = field;
      if (className) td.className = className;
      const holder = code ? td.appendChild(document.createElement("code")) : td;
      holder.textContent = text;
      return td;
    };
    const kind = String(p.kind ?? "");
    row.append(cell(String(id), { className: "num" }), cell(run.commandKindLabels[kind] || kind),
      cell(typeof p.by === "string" && p.by ? p.by : "—"),
      cell(run.commandStateLabels.pending, { field: "state" }),
      cell(commandJson(p.payload, false), { field: "payload", code: true }), cell("", { field: "result", code: true }));
    return row;
  }

  // Whether the row moved on to this state (and shows it).
  function advanceCommand(row, state) {
    if (COMMAND_PROGRESS[state] <= COMMAND_PROGRESS[row.dataset.state]) return false;
    row.dataset.state = state;
    row.querySelector('[data-field="state"]').textContent = run.commandStateLabels[state] || state;
    return true;
  }

  // Mirrors the template filter `json_text`; an empty result reads as nothing.
  function commandJson(value, emptyAsNothing) {
    const object = value && typeof value === "object" ? value : {};
    if (emptyAsNothing && !Object.keys(object).length) return "";
    const text = JSON.stringify(object);
    return text.length > run.commandTextChars ? text.slice(0, run.commandTextChars - 1) + "…" : text;
  }

  function addLogs(lines) {
    if (!lines || !lines.length) return;
    $("logs-empty").hidden = true;
    const pre = $("logs");
    pre.hidden = false;
    const atBottom = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
    const kept = (pre.textContent ? pre.textContent.split("\n") : []).concat(lines).slice(-MAX_LOG_LINES);
    pre.textContent = kept.join("\n");
    if (atBottom) pre.scrollTop = pre.scrollHeight;
  }

  // "Restarts 1 of 2" follows the reconciler's restarted events (a backlog replays them up to the latest).
  function showRestarts(events) {
    const restarts = $("run-restarts");
    events.forEach((event) => {
      const p = event.payload || {};
      if (event.seq <= lastSeq || event.kind !== "restarted") return;
      if (Number.isInteger(p.restart) && Number.isInteger(p.of)) restarts.textContent = `${p.restart} of ${p.of}`;
    });
  }

  // The backlog's state goes with its last event: it is shown once its last page is in.
  let backlogRun = null;
  // Where the log tail ends, for a reconnect to resume after it: all of telemetry batch `lastBatch` (a backlog's or a
  // filled-in gap's `telemetry_seq`, a live update's `batch`), or only its lines through `lastLine` (the lines of a
  // long batch, a backlog or a gap that come before it, in frames of their own, each with its last line's place:
  // `logs_through`).
  let lastBatch = 0, lastLine = null;
  const throughLine = (line) => (line === null ? Infinity : line);

  function logsThrough(batch, line) {
    if (batch > lastBatch || (batch === lastBatch && throughLine(line) > throughLine(lastLine))) {
      lastBatch = batch;
      lastLine = line;
    }
  }

  function onMessage(message) {
    const data = JSON.parse(message.data);
    if (data.type === "pong") return;
    showRestarts(data.events || []);
    addEvents(data.events || []);
    if (data.type === "run.backlog") backlogRun = { state: data.state, exitReason: data.exit_reason };
    if ((data.type === "run.backlog" || data.type === "run.backlog_page") && !data.more && backlogRun) {
      if (backlogRun.state) setState(backlogRun.state);
      showExitReason(backlogRun.exitReason);
      backlogRun = null;
    }
    addMetrics(data.metrics || {});
    addLogs(data.logs);
    if (data.logs_through) logsThrough(data.logs_through.batch, data.logs_through.line);
    logsThrough(Math.max(data.telemetry_seq || 0, data.batch || 0), null);
    stepTimeline.add(data.timelines);
  }

  function connect() {
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    socket = new WebSocket(`${scheme}://${location.host}${run.wsPath}?after_seq=${lastSeq}&after_step=${lastStep}`
      + `&after_batch=${lastBatch}${lastLine === null ? "" : `&after_line=${lastLine}`}`);
    socket.onopen = () => { attempts = 0; setConnection("live", true); };
    socket.onmessage = onMessage;
    socket.onclose = (e) => {
      if (closedByPage) return;
      if (e.code === 4401 || e.code === 4404) { setConnection("not allowed to follow this run", false); return; }
      if (e.code === 4403) { setConnection("no longer allowed to follow this run", false); return; }
      if (e.code === 4400) { setConnection("the stream refused where this page left off: reload the page", false); return; }
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

  // A drill kind that only some roles take (nan_gradients: a trainer rank's gradients) leaves only those roles to pick,
  // and moves the choice to the first of them; the server still refuses any other (workers/engine/operations.py).
  function narrowDrillRoles(form) {
    const kind = form.elements["payload.kind"], role = form.elements["payload.role"];
    const allowed = run.drillKindRoles[kind.value] || null;
    Array.from(role.options).forEach((option) => { option.disabled = allowed !== null && !allowed.includes(option.value); });
    const first = Array.from(role.options).find((option) => !option.disabled);
    if (role.selectedOptions[0]?.disabled && first) role.value = first.value;
  }
  const drillForm = document.querySelector('form[data-command="fault_drill"]');
  if (drillForm) {
    drillForm.elements["payload.kind"].addEventListener("change", () => narrowDrillRoles(drillForm));
    narrowDrillRoles(drillForm);
  }

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
  showDuration();
  setInterval(tick, 250);
  connect();
})();
