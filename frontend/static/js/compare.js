// The compare page: one chart per metric key with one series per run, fetched downsampled from
// /api/v1/runs/<id>/metrics/<key>?buckets=N (steps, values and wall times). The x axis switches between
// step and seconds since each run started; smoothing, zoom and hidden series survive both switches
// where they can (zoom is kept across smoothing, hidden series across everything). Zooming in fetches
// the zoomed range of downsampled series again at full resolution.
(function () {
  "use strict";
  const $ = (id) => document.getElementById(id);
  const data = JSON.parse($("compare-data").textContent);
  const container = $("compare-charts");
  const status = $("charts-status");
  const labels = data.runs.map((run) => run.label);
  const CONCURRENCY = 4;

  // fetched[key][runIndex] = {steps, values, wall_times}
  const fetched = {};
  let axis = "step";
  let smoothing = 0;
  let grid = null;

  function pointsUrl(runId, key, range = null) {
    const path = key.split("/").map(encodeURIComponent).join("/");
    const url = data.pointsUrl.replace("{id}", String(runId)) + path + "?buckets=" + data.buckets;
    return range ? `${url}&start_step=${range[0]}&end_step=${range[1]}` : url;
  }

  function toPoints(series, run) {
    const points = [];
    for (let i = 0; i < series.steps.length; i++) {
      let x = series.steps[i];
      if (axis === "time") {
        const t = series.wall_times ? series.wall_times[i] : null;
        if (t === null || t === undefined || run.t0 === null) continue;
        x = Math.round((t - run.t0) * 1000) / 1000;
      }
      points.push([x, series.values[i]]);
    }
    return points;
  }

  function markDrawn(key) {
    const chart = grid.charts.get(key);
    if (!chart) return;
    const drawn = chart.series.filter((s) => s.points.size > 0).length;
    chart.figure.dataset.runsDrawn = String(drawn);
    chart.figure.dataset.seriesPoints = chart.series.map((s) => s.points.size).join(",");
  }

  function draw(key, runIndex) {
    const series = fetched[key] && fetched[key][runIndex];
    if (!series) return;
    const points = toPoints(series, data.runs[runIndex]);
    if (points.length) grid.add(key, points, runIndex);
    markDrawn(key);
  }

  // The steps of a run that fall in a zoomed x range (step or seconds), one coarse slice wider on each side.
  function stepRange(coarse, run, min, max) {
    if (axis === "step") return [Math.max(0, Math.floor(min)), Math.ceil(max)];
    const xs = toPoints(coarse, run).map(([x]) => x);
    const inside = xs.map((x, i) => (x >= min && x <= max ? i : -1)).filter((i) => i >= 0);
    if (!inside.length) return null;
    const lo = Math.max(0, inside[0] - 1), hi = Math.min(coarse.steps.length - 1, inside[inside.length - 1] + 1);
    return [coarse.steps[lo], coarse.steps[hi]];
  }

  // Zoomed in: fetch the zoomed range of each downsampled series at full resolution (at most `buckets` points).
  async function loadDetail(key, min, max) {
    if (min === null) return;
    const target = grid;
    await Promise.allSettled(data.runs.map(async (run, i) => {
      const coarse = fetched[key] && fetched[key][i];
      if (!coarse || coarse.steps.length >= (run.points[key] || 0)) return;  // already every point
      const range = stepRange(coarse, run, min, max);
      if (!range) return;
      const detail = await FB.api(pointsUrl(run.id, key, range));
      const points = toPoints(detail, run);
      if (grid !== target || !points.length) return;  // the axis changed meanwhile, or nothing there
      // The finer points replace the coarse ones in their range (a mix of both would zigzag).
      const series = grid.chart(key).series[i], lo = points[0][0], hi = points[points.length - 1][0];
      series.deleteRange(lo, hi);
      grid.add(key, points, i);
    }));
    if (grid === target) markDrawn(key);
  }

  // A new grid for the current axis, with every fetched series drawn and the hidden series kept.
  function buildGrid() {
    const hidden = new Map();
    if (grid) {
      grid.charts.forEach((chart, key) => {
        hidden.set(key, chart.plot.series.map((s) => s.show === false));
        chart.destroy();
      });
    }
    container.replaceChildren();
    grid = new FBCharts.ChartGrid(container, { labels, xLabel: axis === "time" ? "seconds" : "step", onZoom: loadDetail,
      first: Object.keys(FBCharts.HEADLINES), notes: FBCharts.HEADLINES });
    grid.smoothing = smoothing;
    container.dataset.axis = axis;
    data.keys.forEach((key) => {
      const chart = grid.chart(key);
      chart.figure.dataset.runsDrawn = "0";
      (hidden.get(key) || []).forEach((isHidden, i) => { if (i > 0 && isHidden) chart.plot.setSeries(i, { show: false }); });
      data.runs.forEach((run, i) => draw(key, i));
    });
    applyFilter();
  }

  async function load() {
    const jobs = [];
    data.keys.forEach((key) => data.runs.forEach((run, i) => { if (run.points[key]) jobs.push([key, i]); }));
    let done = 0, failed = 0, next = 0;
    async function worker() {
      while (next < jobs.length) {
        const [key, i] = jobs[next++];
        try {
          const series = await FB.api(pointsUrl(data.runs[i].id, key));
          (fetched[key] = fetched[key] || {})[i] = series;
          draw(key, i);
        } catch (error) {
          failed++;
        }
        done++;
        status.textContent = `Loaded ${done} of ${jobs.length} series` + (failed ? ` (${failed} failed)` : "") + "…";
      }
    }
    await Promise.all(Array.from({ length: Math.min(CONCURRENCY, jobs.length) }, worker));
    status.textContent = failed ? `${failed} of ${jobs.length} series could not be loaded; reload to retry.`
      : `${data.keys.length} metrics, ${data.runs.length} runs. Drag to zoom, double-click to reset, click a legend entry to hide a run.`;
    container.dataset.state = failed ? "partial" : "ready";
  }

  function applyFilter() {
    const text = $("chart-filter").value.trim().toLowerCase();
    grid.charts.forEach((chart, key) => { chart.figure.hidden = Boolean(text) && !key.toLowerCase().includes(text); });
  }

  document.querySelectorAll('input[name="axis"]').forEach((input) => input.addEventListener("change", () => {
    if (!input.checked || input.value === axis) return;
    axis = input.value;
    buildGrid();
  }));

  $("smoothing").addEventListener("input", (e) => {
    smoothing = Number(e.target.value);
    $("smoothing-value").textContent = smoothing.toFixed(2);
    container.dataset.smoothing = String(smoothing);
    grid.setSmoothing(smoothing);
  });

  $("chart-filter").addEventListener("input", applyFilter);

  // Show only differences: hide the same rows here; the URL keeps the choice (and the form does it without JS).
  const onlyDiff = $("only-diff");
  document.querySelectorAll("#diff-form .js-hide").forEach((el) => { el.hidden = true; });
  onlyDiff.addEventListener("change", () => {
    const table = $("config-diff");
    table.classList.toggle("only-diff", onlyDiff.checked);
    table.querySelectorAll("tr.diff-same").forEach((row) => { row.hidden = onlyDiff.checked; });
    const url = new URL(window.location.href);
    if (onlyDiff.checked) url.searchParams.set("only", "diff"); else url.searchParams.delete("only");
    window.history.replaceState(null, "", url);
  });

  container.dataset.smoothing = "0";
  buildGrid();
  window.FBCompare = { grid: () => grid, fetched, axis: () => axis };
  if (data.keys.length) load(); else container.dataset.state = "ready";
})();
