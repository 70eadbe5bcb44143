// Time-series charts on uPlot. One chart per metric key; each chart may hold several series (runs).
// Zoom, the selection and hidden series survive new data and reconnects: data is merged by step and
// redrawn without resetting scales the user has changed.
(function () {
  "use strict";

  const PALETTE = ["#0b57d0", "#c5221f", "#188038", "#e37400", "#8430ce", "#007b83", "#b3165d", "#5f6368",
    "#1e8e3e", "#a142f4"];

  // [step, value] points by step (a repeated step replaces its value), kept as sorted columns: points that
  // arrive in step order are appended, anything else re-sorts once at the next read.
  class Series {
    constructor() { this.points = new Map(); this.xs = []; this.ys = []; this.ordered = true; }
    add(points) {
      for (const [x, y] of points) {
        const n = this.xs.length;
        if (this.ordered && (n === 0 || x > this.xs[n - 1])) { this.xs.push(x); this.ys.push(y); }
        else if (this.ordered && x === this.xs[n - 1]) this.ys[n - 1] = y;
        else this.ordered = false;
        this.points.set(x, y);
      }
    }
    deleteRange(lo, hi) {
      Array.from(this.points.keys()).forEach((x) => { if (x >= lo && x <= hi) this.points.delete(x); });
      this.ordered = false;
    }
    columns() {
      if (!this.ordered) {
        const entries = Array.from(this.points.entries()).sort((a, b) => a[0] - b[0]);
        this.xs = entries.map((e) => e[0]);
        this.ys = entries.map((e) => e[1]);
        this.ordered = true;
      }
      return [this.xs, this.ys];
    }
  }

  // Exponential moving average that ignores gaps (null); weight 0 leaves the data as it is.
  function smooth(values, weight) {
    if (!weight) return values;
    let last = null;
    return values.map((v) => {
      if (v === null || v === undefined) return null;
      last = last === null ? v : last * weight + (1 - weight) * v;
      return last;
    });
  }

  // A y range with a little padding that never collapses: a span far below the values' magnitude
  // (a metric that barely moves) makes uPlot's tick search run away.
  function yRange(u, min, max) {
    if (min === null || max === null || !isFinite(min) || !isFinite(max)) return [0, 1];
    const magnitude = Math.max(Math.abs(min), Math.abs(max));
    const span = max - min;
    if (span <= magnitude * 1e-6 || span === 0) {
      const pad = magnitude > 0 ? magnitude * 1e-3 : 1;
      return [min - pad, max + pad];
    }
    return [min - span * 0.05, max + span * 0.05];
  }

  // Align several series' sorted, duplicate-free columns on the union of their x values (uPlot wants one x
  // array): a k-way merge, linear in the points.
  function align(columnsList) {
    if (columnsList.length === 1) return [columnsList[0][0].slice(), columnsList[0][1].slice()];
    const at = columnsList.map(() => 0), x = [], ys = columnsList.map(() => []);
    for (;;) {
      let next = null;
      columnsList.forEach(([cx], k) => { if (at[k] < cx.length && (next === null || cx[at[k]] < next)) next = cx[at[k]]; });
      if (next === null) break;
      x.push(next);
      columnsList.forEach(([cx, cy], k) => {
        if (at[k] < cx.length && cx[at[k]] === next) { ys[k].push(cy[at[k]]); at[k]++; } else ys[k].push(null);
      });
    }
    return [x, ...ys];
  }

  // Fewest decimals (up to 6) that write `step` exactly, so neighbouring ticks never read the same.
  function decimalsFor(step) {
    for (let d = 0; d < 6; d++) {
      const scaled = step * 10 ** d;
      if (Math.abs(scaled - Math.round(scaled)) < 1e-6 * Math.max(1, scaled)) return d;
    }
    return 6;
  }

  const PREFIXES = [[1e12, "T"], [1e9, "G"], [1e6, "M"], [1e3, "k"]];
  const MINUS = "-";

  // Tick labels for one axis: a sign on negatives, 1.2k / 3.4M for large values, 1e-4 for small ones,
  // all ticks of an axis in the same scale.
  function tickLabels(splits, increment) {
    const biggest = splits.reduce((m, v) => Math.max(m, Math.abs(v)), 0);
    const step = increment || biggest || 1;
    const prefix = PREFIXES.find(([scale]) => biggest >= scale);
    if (prefix) {
      const [scale, suffix] = prefix;
      const d = decimalsFor(step / scale);
      return splits.map((v) => (v === 0 ? "0" : `${v < 0 ? MINUS : ""}${(Math.abs(v) / scale).toFixed(d)}${suffix}`));
    }
    if (biggest > 0 && biggest < 1e-3) {
      const exponent = Math.floor(Math.log10(biggest));
      const d = decimalsFor(step / 10 ** exponent);
      return splits.map((v) => (v === 0 ? "0"
        : `${v < 0 ? MINUS : ""}${(Math.abs(v) / 10 ** exponent).toFixed(d)}e${exponent}`));
    }
    const d = decimalsFor(step);
    return splits.map((v) => (v === 0 ? "0" : `${v < 0 ? MINUS : ""}${Math.abs(v).toFixed(d)}`));
  }

  // One value (legend, cursor): four significant digits in the same notation as the ticks.
  function valueLabel(v) {
    if (v === null || v === undefined || !isFinite(v)) return "—";
    if (v === 0) return "0";
    const a = Math.abs(v), sign = v < 0 ? MINUS : "";
    const prefix = PREFIXES.find(([scale]) => a >= scale);
    if (prefix) return sign + String(Number((a / prefix[0]).toPrecision(4))) + prefix[1];
    if (a < 1e-3) {
      const [mantissa, exponent] = a.toExponential(3).split("e");
      return `${sign}${Number(mantissa)}e${Number(exponent)}`;
    }
    return sign + String(Number(a.toPrecision(4)));
  }

  // The unit a metric's name says it has ("time/step_s": seconds, "train_tokens_per_s": tok/s), or "".
  function unitOf(key) {
    const name = key.toLowerCase();
    if (/tok(en)?s?(_per_s|\/s)$/.test(name)) return "tok/s";
    if (/steps?(_per_s|\/s)$/.test(name)) return "steps/s";
    if (/(^|[_/])s$/.test(name) || /(^|[_/])seconds$/.test(name)) return "s";
    return "";
  }

  // An axis as wide as its longest label (uPlot's fixed 50 px cut the sign off "-0.0015"). uPlot lays the chart
  // out in up to three passes, and the plot's height can change between them, so a later pass may pick ticks one
  // decimal finer ("0.4995" then "0.49950") after the plot was placed: a decimal label gets one digit of room more,
  // and within a layout the axis only grows.
  function axisSize(u, values, axisIndex, cycle) {
    const axis = u.axes[axisIndex];
    let size = axis.ticks.size + axis.gap + (axis.label ? axis.labelSize : 0);
    const longest = (values || []).reduce((acc, v) => (v.length > acc.length ? v : acc), "");
    if (longest) {
      u.ctx.font = axis.font[0];
      size += u.ctx.measureText(longest.includes(".") ? longest + "0" : longest).width / devicePixelRatio;
    }
    size = Math.ceil(size) + 4;
    return cycle > 1 ? Math.max(size, axis._size || 0) : size;
  }

  // A series' dots are drawn only where its line cannot be: a lone point (the first evaluation, at step 0) is
  // otherwise an empty chart.
  function lonePoint(u, seriesIndex, i0, i1) {
    const values = u.data[seriesIndex];
    let seen = 0;
    for (let i = i0; i <= i1 && seen < 2; i++) if (values[i] !== null && values[i] !== undefined) seen++;
    return seen === 1;
  }

  const HEIGHT = 220;
  const MIN_WIDTH = 160;

  // The width a chart may take: its figure's content box (inside padding and border).
  function contentWidth(element) {
    const style = getComputedStyle(element);
    return element.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
  }

  class Chart {
    // labels: one per series. options.xLabel: "step" or "seconds". options.onZoom(min, max|null). options.note: a
    // line under the title saying what the metric means.
    constructor(container, { title, labels, xLabel = "step", onZoom = null, height = HEIGHT, note = "" }) {
      this.title = title;
      this.labels = labels;
      this.series = labels.map(() => new Series());
      this.smoothing = 0;
      this.zoomed = false;
      this.onZoom = onZoom;
      this.height = height;
      const figure = document.createElement("figure");
      figure.className = "chart";
      figure.dataset.key = title;
      const caption = document.createElement("figcaption");
      caption.textContent = title;
      figure.appendChild(caption);
      if (note) {
        const meaning = document.createElement("p");
        meaning.className = "chart-note";
        meaning.textContent = note;
        figure.appendChild(meaning);
      }
      container.appendChild(figure);
      this.figure = figure;
      const unit = unitOf(title);
      if (unit) figure.dataset.unit = unit;
      const chart = this;
      const ticks = (u, splits, axisIndex, space, increment) => tickLabels(splits, increment);
      this.plot = new uPlot({
        width: this.fittingWidth() || MIN_WIDTH, height,
        scales: { x: { time: false }, y: { range: yRange } },
        axes: [{ label: xLabel, values: ticks }, { label: unit || undefined, labelSize: 20, values: ticks, size: axisSize }],
        cursor: { drag: { x: true, y: false } },
        legend: { live: true },
        series: [{ label: xLabel, value: (u, v) => valueLabel(v) }].concat(labels.map((label, i) => ({
          label, stroke: PALETTE[i % PALETTE.length], width: 1.5, spanGaps: true,
          points: { show: lonePoint, size: 7, fill: PALETTE[i % PALETTE.length] },
          value: (u, v) => valueLabel(v),
        }))),
        hooks: {
          setSelect: [(u) => {
            if (u.select.width <= 0) return;
            const min = u.posToVal(u.select.left, "x"), max = u.posToVal(u.select.left + u.select.width, "x");
            chart.zoomed = true;
            u.setScale("x", { min, max });
            u.setSelect({ left: 0, width: 0, top: 0, height: 0 }, false);
            figure.dataset.zoomed = "true";
            if (chart.onZoom) chart.onZoom(min, max);
          }],
        },
      }, [[], ...labels.map(() => [])], figure);
      figure.addEventListener("dblclick", () => this.resetZoom());
      // uPlot caches where its plot is and refreshes that only on window scroll and resize: re-measure when a
      // pointer arrives, as the page above (startup panel, flash) may have moved the chart since.
      const remeasure = () => this.plot.syncRect(true);
      figure.addEventListener("pointerenter", remeasure);
      figure.addEventListener("pointerdown", remeasure, true);
      // Follow the card's size (grid reflow, window resize, a filter showing it again), once per frame.
      this.resizeFrame = null;
      this.observer = new ResizeObserver(() => {
        if (this.resizeFrame !== null) return;
        this.resizeFrame = requestAnimationFrame(() => { this.resizeFrame = null; this.fit(); });
      });
      this.observer.observe(figure);
    }

    fittingWidth() {
      const width = Math.floor(contentWidth(this.figure));
      return width > 0 ? Math.max(MIN_WIDTH, width) : 0;  // 0: not laid out (hidden)
    }

    fit() {
      const width = this.fittingWidth();
      if (width && width !== this.plot.width) this.plot.setSize({ width, height: this.height });
    }

    destroy() {
      this.observer.disconnect();
      if (this.resizeFrame !== null) cancelAnimationFrame(this.resizeFrame);
      this.plot.destroy();
    }

    add(seriesIndex, points) {
      this.series[seriesIndex].add(points);
    }

    setSmoothing(weight) { this.smoothing = weight; this.redraw(); }

    resetZoom() {
      this.zoomed = false;
      delete this.figure.dataset.zoomed;
      this.redraw();
      if (this.onZoom) this.onZoom(null, null);
    }

    pointCount() {
      return this.series.reduce((n, s) => n + s.points.size, 0);
    }

    redraw() {
      const data = align(this.series.map((s) => s.columns()));
      for (let i = 1; i < data.length; i++) data[i] = smooth(data[i], this.smoothing);
      if (this.zoomed) {
        const { min, max } = this.plot.scales.x;
        this.plot.setData(data, false);
        this.plot.setScale("x", { min, max });
      } else {
        this.plot.setData(data, true);
      }
      this.figure.dataset.points = String(this.pointCount());
      this.figure.dataset.lastX = data[0].length ? String(data[0][data[0].length - 1]) : "";
    }
  }

  // Charts keyed by metric name, created on first data, redrawn at most once per animation frame. options.first:
  // the keys shown before all others, in that order, whenever their data arrives; options.notes: key -> meaning.
  class ChartGrid {
    constructor(container, { labels, xLabel = "step", onZoom = null, first = [], notes = {} }) {
      this.container = container;
      this.first = first;
      this.notes = notes;
      this.labels = labels;
      this.xLabel = xLabel;
      this.onZoom = onZoom;
      this.charts = new Map();
      this.dirty = new Set();
      this.scheduled = false;
      this.smoothing = 0;
    }

    chart(key) {
      let chart = this.charts.get(key);
      if (!chart) {
        chart = new Chart(this.container, {
          title: key, labels: this.labels, xLabel: this.xLabel, note: this.notes[key] || "",
          onZoom: this.onZoom ? (min, max) => this.onZoom(key, min, max) : null,
        });
        chart.smoothing = this.smoothing;
        const rank = this.rank(key);
        const after = Array.from(this.container.children).find((f) => this.charts.has(f.dataset.key)
          && this.rank(f.dataset.key) > rank);
        if (after) this.container.insertBefore(chart.figure, after);
        this.charts.set(key, chart);
      }
      return chart;
    }

    rank(key) {
      const at = this.first.indexOf(key);
      return at === -1 ? this.first.length : at;
    }

    add(key, points, seriesIndex = 0) {
      this.chart(key).add(seriesIndex, points);
      this.dirty.add(key);
      this.schedule();
    }

    setSmoothing(weight) {
      this.smoothing = weight;
      this.charts.forEach((c) => c.setSmoothing(weight));
    }

    schedule() {
      if (this.scheduled) return;
      this.scheduled = true;
      requestAnimationFrame(() => {
        this.scheduled = false;
        this.dirty.forEach((key) => this.charts.get(key).redraw());
        this.dirty.clear();
      });
    }
  }

  // What tells whether a run learns, first on every page that draws runs' metrics, each with what it means; the
  // other metrics follow by name.
  const HEADLINES = {
    "eval/reward_mean": "Held-out reward: the mean reward on problems the run never trains on, at each evaluation. "
      + "Rising means the model learns.",
    "eval/accuracy": "Held-out accuracy: the share of held-out problems answered correctly.",
    "reward/mean": "Training reward: the mean reward of this step's rollouts.",
    "loss": "The trainer's loss per step. SFT's falls as it learns; GRPO's policy loss stays near 0: read its rewards.",
  };

  window.FBCharts = { HEADLINES, Chart, ChartGrid, Series, smooth, align, yRange, tickLabels, valueLabel, unitOf, decimalsFor, PALETTE };
})();
