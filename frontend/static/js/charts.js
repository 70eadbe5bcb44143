// Time-series charts on uPlot. One chart per metric key; each chart may hold several series (runs).
// Zoom, the selection and hidden series survive new data and reconnects: data is merged by step and
// redrawn without resetting scales the user has changed.
(function () {
  "use strict";

  const PALETTE = ["#0b57d0", "#c5221f", "#188038", "#e37400", "#8430ce", "#007b83", "#b3165d", "#5f6368",
    "#1e8e3e", "#a142f4"];

  // Merge [step, value] points into a sorted Map-backed series (a repeated step replaces its value).
  class Series {
    constructor() { this.points = new Map(); }
    add(points) {
      for (const [x, y] of points) this.points.set(x, y);
    }
    sorted() {
      return Array.from(this.points.entries()).sort((a, b) => a[0] - b[0]);
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

  // Align several sorted series on the union of their x values (uPlot wants one x array).
  function align(seriesList) {
    const xs = new Set();
    seriesList.forEach((s) => s.forEach(([x]) => xs.add(x)));
    const x = Array.from(xs).sort((a, b) => a - b);
    const index = new Map(x.map((v, i) => [v, i]));
    const ys = seriesList.map((s) => {
      const column = new Array(x.length).fill(null);
      s.forEach(([px, py]) => { column[index.get(px)] = py; });
      return column;
    });
    return [x, ...ys];
  }

  class Chart {
    // labels: one per series. options.xLabel: "step" or "seconds". options.onZoom(min, max|null).
    constructor(container, { title, labels, xLabel = "step", onZoom = null, height = 220 }) {
      this.title = title;
      this.labels = labels;
      this.series = labels.map(() => new Series());
      this.smoothing = 0;
      this.zoomed = false;
      this.onZoom = onZoom;
      const figure = document.createElement("figure");
      figure.className = "chart";
      figure.dataset.key = title;
      const caption = document.createElement("figcaption");
      caption.textContent = title;
      figure.appendChild(caption);
      container.appendChild(figure);
      this.figure = figure;
      const width = Math.max(260, Math.min(container.clientWidth || 520, 560) - 24);
      const chart = this;
      this.plot = new uPlot({
        width, height,
        scales: { x: { time: false }, y: { range: yRange } },
        axes: [{ label: xLabel }, {}],
        cursor: { drag: { x: true, y: false } },
        legend: { live: true },
        series: [{ label: xLabel }].concat(labels.map((label, i) => ({
          label, stroke: PALETTE[i % PALETTE.length], width: 1.5, spanGaps: true, points: { show: false },
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
      const data = align(this.series.map((s) => s.sorted()));
      for (let i = 1; i < data.length; i++) data[i] = smooth(data[i], this.smoothing);
      if (this.zoomed) {
        const { min, max } = this.plot.scales.x;
        this.plot.setData(data, false);
        this.plot.setScale("x", { min, max });
      } else {
        this.plot.setData(data, true);
      }
      this.figure.dataset.points = String(this.pointCount());
    }
  }

  // Charts keyed by metric name, created on first data, redrawn at most once per animation frame.
  class ChartGrid {
    constructor(container, { labels, xLabel = "step", onZoom = null }) {
      this.container = container;
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
          title: key, labels: this.labels, xLabel: this.xLabel,
          onZoom: this.onZoom ? (min, max) => this.onZoom(key, min, max) : null,
        });
        chart.smoothing = this.smoothing;
        this.charts.set(key, chart);
      }
      return chart;
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

  window.FBCharts = { Chart, ChartGrid, smooth, align, yRange, PALETTE };
})();
