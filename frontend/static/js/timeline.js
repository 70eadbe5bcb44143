// "Where the time goes": the engine's step_timeline records (one a training step: spans of work on every proc,
// each phase's share of the step, each proc's idle share) drawn as a trace in miniature. One row per proc (lane),
// spans coloured by phase on a real-time axis, a marker at each step's start; wheel, buttons and drag zoom and
// pan; a legend with each phase's mean share and each proc's mean idle share over the steps shown.
// Every value of a payload is untrusted: names become text nodes or attributes, anything malformed is skipped.
(function () {
  "use strict";

  const SVG_NS = "http://www.w3.org/2000/svg";
  const MAX_STEPS_HELD = 500;
  const MAX_SPANS_PER_STEP = 5000;
  const MAX_SPANS_DRAWN = 6000;  // past this, the shortest spans in view are left out (and the page says so)
  const MAX_NAME_CHARS = 80;
  const MAX_OFFSET_S = 86400;  // a span more than a day from its step's start is not a span of that step
  const LAST_CHOICES = [5, 10, 20, 50];
  const DEFAULT_LAST = 10;
  const MIN_VIEW_S = 1e-4;
  const ZOOM_STEP = 2;
  const LAYOUT = { markerBand: 20, rowHeight: 26, rowInset: 4, axisBand: 24, tickSpacingPx: 90, minSpanPx: 1 };

  const CONTROLLER = "controller";  // its lane holds what the step loop waited on, not work
  const ROLE_ORDER = ["controller", "process", "trainer", "generator", "reward", "reference"];
  const PHASE_COLOURS = {
    generate: "#1a73e8", generate_wait: "#8ab4f8", weight_load: "#00838f", reward: "#e37400", score_ahead: "#f6bf85",
    reference: "#8430ce", old_logprobs: "#c2185b", forward_backward: "#188038", train: "#81c995",
    all_reduce: "#b3261e", optimizer: "#8d6e00", weight_sync: "#f2b600", data: "#78909c",
  };
  // What each phase the engine records is, said when the pointer rests on its legend entry (a Map: a phase is a
  // payload's word, and "constructor" must not find an object's own property).
  const PHASE_HELP = new Map([
    ["generate", "a generator producing completions"],
    ["generate_wait", "the step loop waiting for the generations the step needs"],
    ["weight_load", "a generator taking in new policy weights"],
    ["reward", "completions scored: reward functions and group advantages"],
    ["score_ahead", "the next batch awaited and scored while the trainer trains (async): off the step's path"],
    ["reference", "the reference model's log-probs, for the KL penalty"],
    ["old_logprobs", "the trainer's log-probs of the batch before its update"],
    ["forward_backward", "the trainer's forward and backward passes"],
    ["train", "the step loop waiting for the trainer's step"],
    ["all_reduce", "gradients summed across the trainer's ranks"],
    ["optimizer", "the optimizer's update of the weights"],
    ["weight_sync", "the trainer staging new weights for the generators"],
    ["data", "the step's examples read and collated"],
  ]);
  const FALLBACK_COLOURS = ["#6d4c41", "#546e7a", "#9e9d24", "#5e35b1", "#d84315", "#00695c"];

  // --- reading payloads ---------------------------------------------------------------------------------------
  const finite = (v) => (typeof v === "number" && Number.isFinite(v) ? v : null);
  const isPlainObject = (v) => v !== null && typeof v === "object" && !Array.isArray(v);

  function nameOf(raw) {
    if (typeof raw !== "string" && typeof raw !== "number") return null;
    const text = String(raw).replace(/[\u0000-\u001f\u007f]/g, " ").trim();
    if (!text) return null;
    return text.length > MAX_NAME_CHARS ? text.slice(0, MAX_NAME_CHARS - 1) + "…" : text;
  }

  // name -> fraction in [0, 1]; anything else is left out.
  function fractions(raw) {
    const out = new Map();
    if (!isPlainObject(raw)) return out;
    Object.keys(raw).forEach((key) => {
      const name = nameOf(key), value = finite(raw[key]);
      if (name !== null && value !== null && value >= 0 && value <= 1) out.set(name, value);
    });
    return out;
  }

  // One payload as a step record, or null when it is not a step timeline at all.
  function readStep(raw) {
    if (!isPlainObject(raw)) return null;
    const step = raw.step, start = finite(raw.start);
    if (!Number.isSafeInteger(step) || step < 0 || start === null || start < 0) return null;
    const laneNames = Array.isArray(raw.lanes) ? raw.lanes.map(nameOf) : [];
    const spans = [];
    (Array.isArray(raw.spans) ? raw.spans : []).slice(0, MAX_SPANS_PER_STEP).forEach((item) => {
      if (!Array.isArray(item) || item.length < 4) return;
      const [index, rawPhase, rawStart, rawEnd] = item;
      if (!Number.isInteger(index) || index < 0 || index >= laneNames.length || laneNames[index] === null) return;
      const phase = nameOf(rawPhase), from = finite(rawStart), to = finite(rawEnd);
      if (phase === null || from === null || to === null || to < from) return;
      if (Math.abs(from) > MAX_OFFSET_S || Math.abs(to) > MAX_OFFSET_S) return;
      spans.push({ lane: laneNames[index], phase, start: from, end: to });
    });
    const declared = finite(raw.seconds);
    const seconds = declared !== null && declared >= 0 && declared <= MAX_OFFSET_S ? declared
      : spans.reduce((longest, span) => Math.max(longest, span.end), 0);
    const truncated = finite(raw.truncated);
    const idle = fractions(raw.idle);
    const lanes = Array.from(new Set(laneNames.filter((name) => name !== null)));
    return { step, start, seconds, end: start + seconds, lanes, spans, shares: fractions(raw.shares), idle,
      truncated: truncated !== null && truncated > 0 ? Math.floor(truncated) : 0 };
  }

  // controller, process, trainer 0, trainer 1, …, generator 0, …, reward, reference, then others by name.
  function laneKey(name) {
    const match = /^(.*?)(?:\s+(\d+))?$/.exec(name);
    const role = match[1], number = match[2] === undefined ? -1 : Number(match[2]);
    const rank = ROLE_ORDER.indexOf(role);
    return { rank: rank === -1 ? ROLE_ORDER.length : rank, role, number };
  }
  function compareLanes(a, b) {
    const ka = laneKey(a), kb = laneKey(b);
    return ka.rank - kb.rank || (ka.role < kb.role ? -1 : ka.role > kb.role ? 1 : 0) || ka.number - kb.number
      || (a < b ? -1 : a > b ? 1 : 0);
  }

  function phaseColour(phase) {
    if (Object.prototype.hasOwnProperty.call(PHASE_COLOURS, phase)) return PHASE_COLOURS[phase];
    let hash = 0;
    for (let i = 0; i < phase.length; i++) hash = (hash * 31 + phase.charCodeAt(i)) >>> 0;
    return FALLBACK_COLOURS[hash % FALLBACK_COLOURS.length];
  }
  function textColourOn(hex) {
    const n = parseInt(hex.slice(1), 16), r = (n >> 16) & 255, g = (n >> 8) & 255, b = n & 255;
    return 0.299 * r + 0.587 * g + 0.114 * b > 150 ? "#1b1f24" : "#ffffff";
  }

  // --- numbers as text ----------------------------------------------------------------------------------------
  const decimalsFor = (increment) => window.FBCharts.decimalsFor(increment);  // charts.js, loaded by every page
  function niceIncrement(range, count) {
    const raw = range / Math.max(1, count);
    const power = 10 ** Math.floor(Math.log10(raw));
    return [1, 2, 5, 10].map((m) => m * power).find((v) => v >= raw * (1 - 1e-9));
  }
  // All ticks of the axis in one unit, picked by the tick increment: 250 ms, 1.5 s, 2 min.
  function tickLabel(value, increment) {
    if (Math.abs(value) < increment * 1e-6) return "0";
    if (increment < 1) return `${(value * 1000).toFixed(decimalsFor(increment * 1000))} ms`;
    if (increment < 60) return `${value.toFixed(decimalsFor(increment))} s`;
    return `${(value / 60).toFixed(decimalsFor(increment / 60))} min`;
  }
  // 0.39 s, 1.23 s, 12.4 s, 45 ms, 3.2 ms
  function duration(s) {
    if (s >= 100) return `${s.toFixed(0)} s`;
    if (s >= 10) return `${s.toFixed(1)} s`;
    if (s >= 0.1) return `${s.toFixed(2)} s`;
    const ms = s * 1000;
    return `${ms >= 10 ? ms.toFixed(0) : ms >= 1 ? ms.toFixed(1) : ms.toFixed(2)} ms`;
  }
  function percent(fraction) {
    const p = fraction * 100;
    if (p === 0) return "0%";
    return p < 1 ? "<1%" : `${Math.round(p + 1e-9)}%`;  // a mean of 0.075s is 7.4999…: half rounds up
  }

  function byShare(items) {
    return items.sort((a, b) => (b.share ?? -1) - (a.share ?? -1) || (a.phase < b.phase ? -1 : a.phase > b.phase ? 1 : 0));
  }
  function unionLength(intervals) {
    let total = 0, reach = -Infinity;
    intervals.slice().sort((a, b) => a[0] - b[0]).forEach(([from, to]) => {
      if (to > reach) { total += to - Math.max(from, reach); reach = to; }
    });
    return total;
  }

  // --- DOM helpers --------------------------------------------------------------------------------------------
  function svg(name, attributes) {
    const node = document.createElementNS(SVG_NS, name);
    Object.entries(attributes || {}).forEach(([key, value]) => node.setAttribute(key, String(value)));
    return node;
  }
  function html(name, className, text) {
    const node = document.createElement(name);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }
  function box(node) {
    const r = node.getBoundingClientRect();
    return { left: r.left, right: r.right, top: r.top, bottom: r.bottom, width: r.width, height: r.height };
  }

  let instances = 0;

  class Timeline {
    // container: an empty element the timeline builds itself in; options.load(last) -> Promise of
    // {timelines: [...]} for the last `last` steps (the REST endpoint), asked when the page holds fewer.
    constructor(container, options) {
      this.container = container;
      this.load = (options && options.load) || null;
      this.id = `fb-timeline-${++instances}`;
      this.steps = new Map();  // step number -> step record (readStep)
      this.ordered = [];  // the records by step number, rebuilt when steps change
      this.last = DEFAULT_LAST;
      this.zoom = null;  // {from, to} (Unix seconds) and the steps shown {firstStep, lastStep} while zoomed or panned
      this.drag = null;
      this.pendingFrame = 0;
      this.asked = new Set();  // `last` values already asked of options.load
      this.drawn = { lanes: [], shown: [], from: 0, to: 1, origin: 0, width: 0, leftOut: 0 };
      this.build();
    }

    build() {
      const c = this.container;
      c.classList.add("step-timeline");
      this.empty = html("p", "muted tl-empty", "No step timeline yet.");

      this.toolbar = html("div", "toolbar tl-toolbar");
      const lastLabel = html("label", "", "Last ");
      this.lastSelect = html("select");
      this.lastSelect.setAttribute("aria-label", "Steps shown");
      LAST_CHOICES.forEach((n) => {
        const option = html("option", "", String(n));
        option.value = String(n);
        option.selected = n === this.last;
        this.lastSelect.append(option);
      });
      lastLabel.append(this.lastSelect, document.createTextNode(" steps"));
      const zoomGroup = html("div", "tl-zoom");
      zoomGroup.setAttribute("role", "group");
      zoomGroup.setAttribute("aria-label", "Zoom the step timeline");
      this.zoomInButton = html("button", "", "Zoom in");
      this.zoomOutButton = html("button", "", "Zoom out");
      this.resetButton = html("button", "", "Reset");
      [this.zoomInButton, this.zoomOutButton, this.resetButton].forEach((b) => { b.type = "button"; zoomGroup.append(b); });
      this.summary = html("span", "muted tl-summary");
      this.summary.setAttribute("aria-live", "polite");
      this.toolbar.append(lastLabel, zoomGroup, this.summary);

      this.body = html("div", "tl-body");
      const chart = html("div", "tl-chart");
      this.laneColumn = html("div", "tl-lanes");
      this.plot = html("div", "tl-plot");
      this.svg = svg("svg", { class: "tl-svg", role: "img", tabindex: "0",
        "aria-label": "Step timeline: spans of work per proc; wheel or + and - zoom, drag or arrow keys pan, 0 resets" });
      this.plot.append(this.svg);
      chart.append(this.laneColumn, this.plot);
      this.readout = html("p", "muted tl-readout", "Point at a span for its details. Wheel to zoom around the cursor, drag to pan, double-click to reset.");
      const main = html("div", "tl-main");
      main.append(chart, this.readout);

      this.legend = html("div", "tl-legend");
      const sharesBlock = html("div", "tl-legend-block");
      sharesBlock.append(html("h3", "", "Share of the step"),
        html("p", "muted tl-note", "Time each phase ran on some proc for the step, as a share of its wall time (mean over the steps shown; phases overlap; work done ahead, in the step before, counts for the step it was for)."));
      this.sharesList = html("ul", "tl-shares");
      sharesBlock.append(this.sharesList);
      this.waitsBlock = html("div", "tl-legend-block");
      this.waitsBlock.append(html("h3", "", "The step loop waited on"),
        html("p", "muted tl-note", "The controller lane: share of the step spent waiting on each (mean over the steps shown)."));
      this.waitsList = html("ul", "tl-shares tl-waits");
      this.waitsBlock.append(this.waitsList);
      const idleBlock = html("div", "tl-legend-block");
      idleBlock.append(html("h3", "", "Idle per proc"),
        html("p", "muted tl-note", "Share of the step's wall time each proc did no work for it (mean over the steps shown)."));
      this.idleList = html("ul", "tl-idle");
      idleBlock.append(this.idleList);
      this.legend.append(sharesBlock, this.waitsBlock, idleBlock);
      this.body.append(main, this.legend);

      c.replaceChildren(this.empty, this.toolbar, this.body);
      this.toolbar.hidden = true;
      this.body.hidden = true;
      this.listen();
    }

    listen() {
      this.lastSelect.addEventListener("change", () => this.setLast(Number(this.lastSelect.value)));
      this.zoomInButton.addEventListener("click", () => this.zoomBy(1 / ZOOM_STEP, 0.5));
      this.zoomOutButton.addEventListener("click", () => this.zoomBy(ZOOM_STEP, 0.5));
      this.resetButton.addEventListener("click", () => this.reset());
      this.svg.addEventListener("wheel", (e) => this.onWheel(e), { passive: false });
      this.svg.addEventListener("pointerdown", (e) => this.onPointerDown(e));
      this.svg.addEventListener("pointermove", (e) => this.onPointerMove(e));
      this.svg.addEventListener("pointerup", (e) => this.onPointerUp(e));
      this.svg.addEventListener("pointercancel", (e) => this.onPointerUp(e));
      this.svg.addEventListener("dblclick", (e) => { e.preventDefault(); this.reset(); });
      this.svg.addEventListener("keydown", (e) => this.onKey(e));
      this.svg.addEventListener("mouseover", (e) => this.onHover(e));
      if (window.ResizeObserver) {
        new ResizeObserver(() => { if (this.plot.clientWidth !== this.drawn.width) this.render(); }).observe(this.plot);
      } else {
        window.addEventListener("resize", () => this.render());
      }
    }

    // --- data ---
    // Payloads in any order; a step seen before is replaced (a run restored from a checkpoint runs it again).
    // onlyNew: keep the steps already held (an answer from the REST endpoint may be older than the live ones).
    add(payloads, { onlyNew = false } = {}) {
      if (!Array.isArray(payloads)) return;
      let changed = false;
      payloads.forEach((raw) => {
        const record = readStep(raw);
        if (record === null || (onlyNew && this.steps.has(record.step))) return;
        this.steps.set(record.step, record);
        changed = true;
      });
      if (!changed) return;
      this.ordered = Array.from(this.steps.values()).sort((a, b) => a.step - b.step);
      if (this.ordered.length > MAX_STEPS_HELD) {
        this.ordered.splice(0, this.ordered.length - MAX_STEPS_HELD).forEach((r) => this.steps.delete(r.step));
      }
      this.render();
    }

    // The steps of the newest attempt: a step that ended before a lower step began was run by an attempt that
    // was later restored from a checkpoint, and is left out until it is run again.
    current() {
      const kept = [];
      let latestStart = -Infinity;
      this.ordered.forEach((record) => {
        if (record.end >= latestStart) kept.push(record);
        latestStart = Math.max(latestStart, record.start);
      });
      return kept;
    }

    shownSteps() {
      const steps = this.current();
      if (this.zoom) return steps.filter((r) => r.step >= this.zoom.firstStep && r.step <= this.zoom.lastStep);
      return steps.slice(-this.last);
    }

    setLast(n) {
      if (!LAST_CHOICES.includes(n)) return;
      this.last = n;
      this.lastSelect.value = String(n);
      this.zoom = null;
      this.render();
      this.loadMore();
    }

    // When the user asks for more steps than the page holds and earlier ones may exist, ask the server once.
    async loadMore() {
      const held = this.current();
      if (!this.load || held.length >= this.last || !held.length || held[0].step === 0 || this.asked.has(this.last)) return;
      this.asked.add(this.last);
      try {
        const answer = await this.load(this.last);
        this.add(answer && answer.timelines, { onlyNew: true });
      } catch (error) {
        console.warn("could not load earlier step timelines", error);
      }
    }

    // --- view ---
    // The time the shown steps cover, Unix seconds: from the earliest span (work launched before the first shown
    // step starts below its start) to the end of the last step or span.
    extent(shown) {
      let from = shown[0].start, to = shown[0].end;
      shown.forEach((r) => {
        to = Math.max(to, r.end);
        r.spans.forEach((s) => { from = Math.min(from, r.start + s.start); to = Math.max(to, r.start + s.end); });
      });
      if (to - from < MIN_VIEW_S) to = from + MIN_VIEW_S;
      return { from, to };
    }

    viewOf(shown) {
      const full = this.extent(shown);
      return this.zoom ? { from: this.zoom.from, to: this.zoom.to, full } : { from: full.from, to: full.to, full };
    }

    // factor < 1 zooms in; anchor is where the zoom centres, as a fraction of the plot's width.
    zoomBy(factor, anchor) {
      const shown = this.shownSteps();
      if (!shown.length) return;
      const view = this.viewOf(shown), full = view.full;
      const fullWidth = full.to - full.from, oldWidth = view.to - view.from;
      const width = Math.max(MIN_VIEW_S, Math.min(fullWidth, oldWidth * factor));
      if (width >= fullWidth * (1 - 1e-9)) { this.reset(); return; }
      const at = view.from + oldWidth * anchor;
      this.setView(at - (at - view.from) * (width / oldWidth), width, shown);
    }

    panBy(seconds) {
      if (!this.zoom) return;
      const shown = this.shownSteps();
      if (!shown.length) return;
      this.setView(this.zoom.from + seconds, this.zoom.to - this.zoom.from, shown);
    }

    setView(from, width, shown) {
      const full = this.extent(shown);
      const clamped = Math.max(full.from, Math.min(from, full.to - width));
      this.zoom = { from: clamped, to: clamped + width, firstStep: shown[0].step, lastStep: shown[shown.length - 1].step };
      this.scheduleRender();
    }

    reset() {
      if (!this.zoom) return;
      this.zoom = null;
      this.render();
    }

    // --- input ---
    onWheel(e) {
      if (!this.drawn.shown.length) return;
      e.preventDefault();
      const unit = e.deltaMode === 1 ? 16 : e.deltaMode === 2 ? 400 : 1;
      const rect = this.svg.getBoundingClientRect();
      if (Math.abs(e.deltaX) > Math.abs(e.deltaY)) {
        this.panBy(e.deltaX * unit / rect.width * (this.drawn.to - this.drawn.from));
        return;
      }
      const anchor = Math.max(0, Math.min(1, (e.clientX - rect.left) / rect.width));
      this.zoomBy(Math.max(0.5, Math.min(2, Math.exp(e.deltaY * unit * 0.002))), anchor);
    }

    onPointerDown(e) {
      if (e.button !== 0 || !this.zoom) return;
      this.drag = { pointer: e.pointerId, x: e.clientX, from: this.zoom.from };
      this.svg.setPointerCapture(e.pointerId);
      this.svg.classList.add("tl-dragging");
    }

    onPointerMove(e) {
      if (!this.drag || e.pointerId !== this.drag.pointer || !this.zoom) return;
      const width = this.zoom.to - this.zoom.from;
      const seconds = -(e.clientX - this.drag.x) / Math.max(1, this.drawn.width) * width;
      const shown = this.shownSteps();
      if (shown.length) this.setView(this.drag.from + seconds, width, shown);
    }

    onPointerUp(e) {
      if (!this.drag || e.pointerId !== this.drag.pointer) return;
      this.drag = null;
      this.svg.classList.remove("tl-dragging");
    }

    onKey(e) {
      const width = this.drawn.to - this.drawn.from;
      const actions = { "+": () => this.zoomBy(1 / ZOOM_STEP, 0.5), "=": () => this.zoomBy(1 / ZOOM_STEP, 0.5),
        "-": () => this.zoomBy(ZOOM_STEP, 0.5), "0": () => this.reset(), Escape: () => this.reset(),
        ArrowLeft: () => this.panBy(-width / 10), ArrowRight: () => this.panBy(width / 10) };
      if (!actions[e.key]) return;
      e.preventDefault();
      actions[e.key]();
    }

    onHover(e) {
      const target = e.target.closest ? e.target.closest("rect.tl-span") : null;
      if (!target) return;
      const lane = target.getAttribute("data-lane"), phase = target.getAttribute("data-phase");
      const step = target.getAttribute("data-step");
      const start = Number(target.getAttribute("data-start")), end = Number(target.getAttribute("data-end"));
      this.readout.textContent = `${lane} · ${phase} · step ${step} · ${duration(end - start)} ` +
        `(from ${duration(Math.abs(start))}${start < 0 ? " before" : " after"} the step's start)`;
    }

    scheduleRender() {
      if (this.pendingFrame) return;
      this.pendingFrame = requestAnimationFrame(() => { this.pendingFrame = 0; this.render(); });
    }

    // --- drawing ---
    render() {
      if (this.pendingFrame) { cancelAnimationFrame(this.pendingFrame); this.pendingFrame = 0; }
      const shown = this.shownSteps();
      const hasData = shown.length > 0;
      this.empty.hidden = hasData;
      this.toolbar.hidden = !hasData;
      this.body.hidden = !hasData;
      if (!hasData) return;
      const width = this.plot.clientWidth;
      const lanes = Array.from(new Set(shown.flatMap((r) => r.lanes.concat(r.spans.map((s) => s.lane))))).sort(compareLanes);
      const view = this.viewOf(shown);
      this.drawn = { lanes, shown, from: view.from, to: view.to, origin: shown[0].start, width, leftOut: 0 };
      this.drawLanes(lanes, shown);
      if (width > 0) this.drawPlot(lanes, shown, view, width);
      this.drawLegend(lanes, shown);
      this.drawControls(shown);
    }

    drawLanes(lanes, shown) {
      const idle = this.meanIdle(lanes, shown);
      const header = html("div", "tl-lane-head", "step");
      header.style.height = `${LAYOUT.markerBand}px`;
      const footer = html("div", "tl-lane-foot", "time");
      footer.style.height = `${LAYOUT.axisBand}px`;
      const rows = lanes.map((lane) => {
        const label = html("div", "tl-lane", lane);
        label.setAttribute("data-lane", lane);
        label.title = idle.has(lane) ? `${lane} · idle ${percent(idle.get(lane))}` : lane;
        label.style.height = label.style.lineHeight = `${LAYOUT.rowHeight}px`;
        return label;
      });
      this.laneColumn.replaceChildren(header, ...rows, footer);
    }

    drawPlot(lanes, shown, view, width) {
      const { markerBand, rowHeight, rowInset, axisBand } = LAYOUT;
      const rowsBottom = markerBand + lanes.length * rowHeight;
      const height = rowsBottom + axisBand;
      const scale = width / (view.to - view.from);
      const x = (t) => (t - view.from) * scale;
      const laneRow = new Map(lanes.map((lane, i) => [lane, i]));
      const nodes = [];

      const clipId = `${this.id}-clip`;
      const defs = svg("defs");
      const clip = svg("clipPath", { id: clipId });
      clip.append(svg("rect", { x: 0, y: 0, width, height: rowsBottom }));
      defs.append(clip);
      nodes.push(defs);

      lanes.forEach((lane, i) => {
        const row = svg("rect", { class: `tl-row${i % 2 ? " tl-row-odd" : ""}`, x: 0, y: markerBand + i * rowHeight,
          width, height: rowHeight, "data-lane": lane });
        nodes.push(row);
      });

      const markers = svg("g", { class: "tl-steps", "clip-path": `url(#${clipId})` });
      const markerLabels = svg("g", { class: "tl-step-labels" });
      let labelLimit = width;  // newest first: a label is drawn only where it does not run into the next one
      shown.slice().reverse().forEach((record) => {
        const at = x(record.start);
        if (at < -0.5 || at > width + 0.5) return;
        const marker = svg("g", { class: "tl-step", "data-step": record.step });
        marker.append(svg("line", { x1: at, x2: at, y1: markerBand - 4, y2: rowsBottom }));
        const title = svg("title");
        title.textContent = `step ${record.step} · ${duration(record.seconds)}`;
        marker.append(title);
        markers.append(marker);
        const text = String(record.step), textWidth = text.length * 7 + 4;
        let labelX = at + 3, anchor = "start";
        if (labelX + textWidth > width) { labelX = at - 3; anchor = "end"; }
        const left = anchor === "start" ? labelX : labelX - textWidth, right = left + textWidth;
        if (right > labelLimit || left < 0) return;
        labelLimit = left - 4;
        const label = svg("text", { class: "tl-step-label", x: labelX, y: markerBand - 7, "text-anchor": anchor,
          "data-step": record.step });
        label.textContent = text;
        markerLabels.append(label);
      });
      nodes.push(markers, markerLabels);

      // The spans in view, the longest first when there are too many to draw.
      let inView = [];
      shown.forEach((record) => record.spans.forEach((span) => {
        const from = record.start + span.start, to = record.start + span.end;
        if (to >= view.from && from <= view.to && laneRow.has(span.lane)) inView.push({ record, span, from, to });
      }));
      if (inView.length > MAX_SPANS_DRAWN) {
        this.drawn.leftOut = inView.length - MAX_SPANS_DRAWN;
        inView = inView.sort((a, b) => (b.to - b.from) - (a.to - a.from)).slice(0, MAX_SPANS_DRAWN);
      }
      const spans = svg("g", { class: "tl-spans", "clip-path": `url(#${clipId})` });
      inView.forEach(({ record, span, from, to }) => {
        const left = Math.max(-2, x(from)), right = Math.min(width + 2, x(to));
        const spanWidth = Math.max(LAYOUT.minSpanPx, right - left);
        const y = markerBand + laneRow.get(span.lane) * rowHeight + rowInset;
        const colour = phaseColour(span.phase);
        const rect = svg("rect", { class: "tl-span", x: left, y, width: spanWidth, height: rowHeight - 2 * rowInset,
          fill: colour, "data-lane": span.lane, "data-phase": span.phase, "data-step": record.step,
          "data-start": span.start, "data-end": span.end });
        const title = svg("title");
        title.textContent = `${span.lane} · ${span.phase} · step ${record.step} · ${duration(span.end - span.start)}`;
        rect.append(title);
        spans.append(rect);
        if (spanWidth >= span.phase.length * 7 + 10) {
          const label = svg("text", { class: "tl-span-label", x: Math.max(left, 0) + 4, y: y + (rowHeight - 2 * rowInset) / 2,
            fill: textColourOn(colour) });
          label.textContent = span.phase;
          spans.append(label);
        }
      });
      nodes.push(spans);

      const axis = svg("g", { class: "tl-axis" });
      axis.append(svg("line", { x1: 0, x2: width, y1: rowsBottom, y2: rowsBottom }));
      const origin = shown[0].start;
      const increment = niceIncrement(view.to - view.from, Math.floor(width / LAYOUT.tickSpacingPx));
      const first = Math.ceil((view.from - origin) / increment - 1e-9), last = Math.floor((view.to - origin) / increment + 1e-9);
      for (let k = first; k <= last && k - first < 200; k++) {
        const value = k * increment, at = x(origin + value);
        axis.append(svg("line", { x1: at, x2: at, y1: rowsBottom, y2: rowsBottom + 4 }));
        const anchor = at < 24 ? "start" : at > width - 24 ? "end" : "middle";
        const label = svg("text", { class: "tl-tick", x: at, y: rowsBottom + 17, "text-anchor": anchor });
        label.textContent = tickLabel(value, increment);
        axis.append(label);
      }
      nodes.push(axis);

      this.svg.setAttribute("width", width);
      this.svg.setAttribute("height", height);
      this.svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
      this.svg.replaceChildren(...nodes);
    }

    meanIdle(lanes, shown) {
      const idle = new Map();
      lanes.forEach((lane) => {
        const values = shown.filter((r) => r.idle.has(lane)).map((r) => r.idle.get(lane));
        if (values.length) idle.set(lane, values.reduce((a, b) => a + b, 0) / values.length);
      });
      return idle;
    }

    // Each phase's mean share over the shown steps (a step without the phase counts as 0), largest first;
    // a phase drawn on a proc but without a share is listed (its colour needs a key) with no figure.
    meanShares(shown) {
      const phases = new Set();
      shown.forEach((r) => {
        r.shares.forEach((_, phase) => phases.add(phase));
        r.spans.forEach((s) => { if (s.lane !== CONTROLLER) phases.add(s.phase); });
      });
      return byShare(Array.from(phases).map((phase) => {
        const withShare = shown.filter((r) => r.shares.has(phase));
        const share = withShare.length ? withShare.reduce((sum, r) => sum + r.shares.get(phase), 0) / shown.length : null;
        return { phase, share };
      }));
    }

    // What the step loop waited on: per phase of the controller's lane, the share of each step its spans cover
    // (inside the step), mean over the shown steps that have a controller lane.
    meanWaits(shown) {
      const withController = shown.filter((r) => r.lanes.includes(CONTROLLER));
      const totals = new Map();
      withController.forEach((r) => {
        const byPhase = new Map();
        r.spans.forEach((s) => {
          if (s.lane !== CONTROLLER) return;
          const from = Math.max(0, s.start), to = Math.min(r.seconds, s.end);
          if (to > from) byPhase.set(s.phase, (byPhase.get(s.phase) || []).concat([[from, to]]));
          else if (!byPhase.has(s.phase)) byPhase.set(s.phase, []);
        });
        byPhase.forEach((intervals, phase) => {
          const share = r.seconds > 0 ? Math.min(1, unionLength(intervals) / r.seconds) : 0;
          totals.set(phase, (totals.get(phase) || 0) + share);
        });
      });
      return byShare(Array.from(totals.entries()).map(([phase, total]) => ({ phase, share: total / withController.length })));
    }

    drawLegend(lanes, shown) {
      const shareItem = ({ phase, share }) => {
        const item = html("li");
        item.setAttribute("data-phase", phase);
        if (PHASE_HELP.has(phase)) item.title = `${phase}: ${PHASE_HELP.get(phase)}`;
        const swatch = html("span", "swatch");
        swatch.style.backgroundColor = phaseColour(phase);
        const bar = html("span", "tl-bar");
        const fill = html("span");
        fill.style.width = `${share === null ? 0 : Math.min(100, share * 100)}%`;
        fill.style.backgroundColor = phaseColour(phase);
        bar.append(fill);
        item.append(swatch, html("span", "tl-name", phase), document.createTextNode(" "),
          html("span", "tl-value", share === null ? "—" : percent(share)), bar);
        return item;
      };
      this.sharesList.replaceChildren(...this.meanShares(shown).map(shareItem));
      const waits = this.meanWaits(shown);
      this.waitsBlock.hidden = waits.length === 0;
      this.waitsList.replaceChildren(...waits.map(shareItem));
      const idle = this.meanIdle(lanes, shown);
      this.idleList.replaceChildren(...lanes.filter((lane) => idle.has(lane)).map((lane) => {
        const item = html("li");
        item.setAttribute("data-lane", lane);
        const bar = html("span", "tl-bar tl-bar-idle");
        const fill = html("span");
        fill.style.width = `${Math.min(100, idle.get(lane) * 100)}%`;
        bar.append(fill);
        item.append(html("span", "tl-name", lane), document.createTextNode(" "),
          html("span", "tl-value", `idle ${percent(idle.get(lane))}`), bar);
        return item;
      }));
    }

    drawControls(shown) {
      const first = shown[0].step, last = shown[shown.length - 1].step;
      const meanStep = shown.reduce((sum, r) => sum + r.seconds, 0) / shown.length;
      const truncated = shown.reduce((sum, r) => sum + r.truncated, 0);
      const parts = [first === last ? `Step ${first}` : `Steps ${first}–${last}`, `mean step ${duration(meanStep)}`];
      if (this.zoom) {
        const newer = this.current().filter((r) => r.step > last).length;
        parts.push(`zoomed to ${duration(this.zoom.to - this.zoom.from)}` +
          (newer ? `; ${newer} newer step${newer === 1 ? "" : "s"} held until Reset` : ""));
      }
      if (truncated) parts.push(`${truncated} short span${truncated === 1 ? "" : "s"} left out by the engine`);
      if (this.drawn.leftOut) parts.push(`${this.drawn.leftOut} shortest spans not drawn at this zoom`);
      this.summary.textContent = parts.join(" · ");
      this.zoomOutButton.disabled = this.resetButton.disabled = !this.zoom;
      this.container.dataset.zoomed = this.zoom ? "true" : "false";
      this.container.dataset.steps = String(shown.length);
      this.container.dataset.lastStep = String(last);
    }

    // What a person sees, in page (client) coordinates, for tests and for anyone debugging the drawing.
    geometry() {
      const d = this.drawn;
      const rows = new Map(Array.from(this.svg.querySelectorAll("rect.tl-row")).map((r) => [r.getAttribute("data-lane"), r]));
      const labels = new Map(Array.from(this.laneColumn.querySelectorAll(".tl-lane")).map((l) => [l.getAttribute("data-lane"), l]));
      return {
        zoomed: this.zoom !== null,
        view: { from: d.from - d.origin, to: d.to - d.origin },
        card: box(this.container), plot: box(this.svg), laneColumn: box(this.laneColumn), legend: box(this.legend),
        steps: d.shown.map((r) => r.step),
        lanes: d.lanes.map((lane) => {
          const label = labels.get(lane);
          return { name: lane, label: label ? box(label) : null, labelText: label ? label.textContent : null,
            labelClipped: label ? label.scrollWidth > label.clientWidth : null, row: rows.has(lane) ? box(rows.get(lane)) : null };
        }),
        spans: Array.from(this.svg.querySelectorAll("rect.tl-span")).map((rect) => ({
          lane: rect.getAttribute("data-lane"), phase: rect.getAttribute("data-phase"),
          step: Number(rect.getAttribute("data-step")), start: Number(rect.getAttribute("data-start")),
          end: Number(rect.getAttribute("data-end")), title: rect.querySelector("title").textContent, box: box(rect) })),
        markers: Array.from(this.svg.querySelectorAll("g.tl-step")).map((g) => ({
          step: Number(g.getAttribute("data-step")), box: box(g.querySelector("line")) })),
        markerLabels: Array.from(this.svg.querySelectorAll("text.tl-step-label")).map((t) => ({ text: t.textContent, box: box(t) })),
        ticks: Array.from(this.svg.querySelectorAll("text.tl-tick")).map((t) => ({ text: t.textContent, box: box(t) })),
        shares: Array.from(this.sharesList.children).map((li) => li.textContent),
        waits: Array.from(this.waitsList.children).map((li) => li.textContent),
        idle: Array.from(this.idleList.children).map((li) => li.textContent),
        summary: this.summary.textContent,
      };
    }
  }

  window.FBTimeline = { Timeline, readStep, compareLanes, phaseColour };
})();
