// The Launch page's what-if panel: POST /api/v1/plans with the editor's config (and the overrides and host pins
// the launch would add), then one row per scale for the placement as written and one for the best split.
(function () {
  "use strict";
  const panel = document.getElementById("plan-panel");
  if (!panel || !window.FBLaunch) return;
  const $ = (id) => document.getElementById(id);
  const button = $("plan-button"), status = $("plan-status"), table = $("plan-table"), configured = $("plan-configured");
  let sequence = 0;

  const fixed = (value, digits) => Number(value).toLocaleString("en-US",
    { minimumFractionDigits: digits, maximumFractionDigits: digits });
  const percent = (value) => `${Math.round(100 * value)}%`;

  function cell(text, numeric) {
    const td = document.createElement("td");
    td.textContent = text;
    if (numeric) td.className = "num";
    return td;
  }

  function row(devices, label, p, gain) {
    const tr = document.createElement("tr");
    tr.dataset.devices = String(devices);
    tr.dataset.kind = label;
    tr.append(cell(label === "as written" ? String(devices) : "", true), cell(label),
      cell(p.placement.description + (p.fits ? "" : " (does not fit)")), cell(fixed(p.step_s, 3), true),
      cell(fixed(p.sequences_per_s, 1), true), cell(fixed(p.train_tokens_per_s, 0), true),
      cell(percent(p.utilization.generator), true), cell(percent(p.utilization.trainer), true),
      cell(p.bottleneck), cell(gain === null ? "" : `×${fixed(gain, 2)}`, true));
    if (!p.fits) tr.title = p.notes.join(" ");
    return tr;
  }

  function gpus() {
    return $("plan-gpus").value.split(",").map((part) => part.trim()).filter(Boolean).map(Number);
  }

  async function predict() {
    const mine = ++sequence;
    status.textContent = "Predicting…";
    status.className = "muted";
    const calibration = $("plan-calibration").value;
    const body = { project: window.FBLaunch.project, recipe: window.FBLaunch.recipe(), yaml: window.FBLaunch.config(),
      overrides: window.FBLaunch.overrideLines(), device: $("plan-device").value, gpus: gpus(),
      calibration_run: calibration ? Number(calibration) : null };
    try {
      const plan = await window.FB.api(panel.dataset.planUrl, { method: "POST", body });
      if (mine !== sequence) return;
      const rows = [];
      for (const scale of plan.scales) {
        rows.push(row(scale.devices, "as written", scale.as_written, null), row(scale.devices, "best", scale.best, scale.gain));
      }
      table.tBodies[0].replaceChildren(...rows);
      table.hidden = false;
      const c = plan.as_configured;
      configured.textContent = `As configured (${plan.placement}, ${c.devices} device${c.devices === 1 ? "" : "s"} of ` +
        `${plan.device.toUpperCase()}): ${fixed(c.step_s, 3)} s a step, ${fixed(c.sequences_per_s, 1)} sequences/s; ` +
        `bottleneck: ${c.bottleneck}.`;
      status.textContent = `${plan.model.name} (${fixed(plan.model.params / 1e6, 1)}M parameters); calibration: ${plan.calibration_note}.`;
      status.className = "ok";
    } catch (error) {
      if (mine !== sequence) return;
      const problems = (error.data && error.data.errors) || [];
      status.textContent = problems.length
        ? "Cannot predict: " + problems.map((p) => `${p.field || "config"}: ${p.message}`).join("; ")
        : "Cannot predict just now.";
      status.className = "error";
      table.hidden = true;
      configured.textContent = "";
    }
  }

  button.addEventListener("click", predict);
})();
