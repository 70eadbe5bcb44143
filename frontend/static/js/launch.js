// The Launch page: presets, line numbers, and live validation of the config as the user types
// (POST /api/v1/configs/validate, debounced). Each problem is shown at its field path and YAML line,
// the editor is marked aria-invalid, and the launch button stays disabled until the config is valid.
(function () {
  "use strict";
  const form = document.getElementById("launch-form");
  if (!form) return;
  const $ = (id) => document.getElementById(id);
  const editor = $("config_yaml"), gutter = $("config-gutter"), overrides = $("overrides");
  const experiment = $("experiment"), newBox = $("new-experiment"), newRecipe = $("new_recipe"), preset = $("preset");
  const status = $("config-status"), errorList = $("config-errors"), overrideErrors = $("overrides-errors");
  const button = $("launch-button");
  const canLaunch = form.dataset.canLaunch === "true";
  const presets = JSON.parse($("launch-presets").textContent);
  const placementRoles = JSON.parse($("launch-placement-roles").textContent);
  let loadedText = editor.value;  // the text last loaded from a preset or the server: edits after it are "dirty"
  let sequence = 0, timer = null, schema = null, invalid = errorList.children.length > 0;

  const recipe = () => (experiment.value === "new" ? newRecipe.value
    : (experiment.selectedOptions[0] && experiment.selectedOptions[0].dataset.recipe) || newRecipe.value);

  function overrideLines() {
    const lines = overrides.value.split("\n").map((l) => l.trim()).filter((l) => l && !l.startsWith("#"));
    const hosts = [...form.querySelectorAll('input[name="hosts"]:checked')].map((el) => el.value);
    if (hosts.length) {
      for (const role of placementRoles[recipe()] || ["trainer"]) lines.push(`placement.${role}.hosts=${JSON.stringify(hosts)}`);
    }
    return lines;
  }

  function drawGutter(bad = new Map()) {
    const count = editor.value.split("\n").length;
    const rows = [];
    for (let n = 1; n <= count; n++) {
      const row = document.createElement("div");
      row.textContent = n;
      if (bad.has(n)) { row.className = "bad"; row.title = bad.get(n); }
      rows.push(row);
    }
    gutter.replaceChildren(...rows);
    gutter.scrollTop = editor.scrollTop;
  }

  // JSON Schema hints: what a field may be (allowed values, bounds, description), fetched once.
  async function loadSchema() {
    if (schema === null) schema = window.FB.api(form.dataset.schemaUrl).catch(() => ({}));
    return schema;
  }

  function resolve(root, node) {
    for (let i = 0; node && i < 10; i++) {
      if (node.$ref) node = root.$defs && root.$defs[node.$ref.split("/").pop()];
      else if (node.anyOf) node = node.anyOf.find((n) => n.type !== "null") || node.anyOf[0];
      else if (node.allOf && node.allOf.length === 1) node = node.allOf[0];
      else break;
    }
    return node;
  }

  function hintFor(root, field) {
    if (!root || !root.properties || !field) return "";
    let node = resolve(root, root), parent = null;
    for (const part of field.split(".")) {
      parent = node;
      if (node && node.properties && node.properties[part]) node = resolve(root, node.properties[part]);
      else if (node && node.items && /^\d+$/.test(part)) node = resolve(root, node.items);
      else { node = null; break; }
    }
    if (!node) return parent && parent.properties ? `known keys: ${Object.keys(parent.properties).join(", ")}` : "";
    const target = node.items ? resolve(root, node.items) : node;
    const bits = [];
    if (target.enum) bits.push(`allowed: ${target.enum.join(", ")}`);
    if (target.const !== undefined) bits.push(`must be ${target.const}`);
    if (target.minimum !== undefined) bits.push(`≥ ${target.minimum}`);
    if (target.exclusiveMinimum !== undefined) bits.push(`> ${target.exclusiveMinimum}`);
    if (target.maximum !== undefined && target.maximum < 2 ** 31 - 1) bits.push(`≤ ${target.maximum}`);
    if (target.exclusiveMaximum !== undefined) bits.push(`< ${target.exclusiveMaximum}`);
    if (node.description) bits.push(node.description);
    return bits.join("; ");
  }

  function item(problem, hint) {
    const li = document.createElement("li");
    li.className = "field-error";
    li.dataset.field = problem.field;
    const code = document.createElement("code");
    code.textContent = problem.field || "config";
    li.append(code);
    let where = "";
    if (problem.line) { where += ` (line ${problem.line})`; li.dataset.line = problem.line; }
    if (problem.override) where += ` (override ${problem.override})`;
    li.append(`${where}: ${problem.message}`);
    if (hint) {
      const small = document.createElement("span");
      small.className = "hint";
      small.textContent = ` — ${hint}`;
      li.append(small);
    }
    return li;
  }

  function setButton() {
    button.disabled = !canLaunch || invalid;
  }

  async function show(errors) {
    const root = errors.length ? await loadSchema() : null;
    const inConfig = [], inOverrides = [], bad = new Map();
    for (const problem of errors) {
      const li = item(problem, hintFor(root, problem.field === "overrides" ? "" : problem.field));
      if (problem.override || problem.field === "overrides") inOverrides.push(li); else inConfig.push(li);
      if (problem.line && !problem.override) bad.set(problem.line, `${problem.field || "config"}: ${problem.message}`);
    }
    errorList.replaceChildren(...inConfig);
    overrideErrors.replaceChildren(...inOverrides);
    editor.setAttribute("aria-invalid", inConfig.length ? "true" : "false");
    overrides.setAttribute("aria-invalid", inOverrides.length ? "true" : "false");
    invalid = errors.length > 0;
    status.textContent = invalid ? `${errors.length} problem${errors.length === 1 ? "" : "s"} with this config.`
      : "Config is valid.";
    status.className = invalid ? "error" : "ok";
    drawGutter(bad);
    setButton();
  }

  async function validate() {
    const mine = ++sequence;
    try {
      const result = await window.FB.api(form.dataset.validateUrl,
        { method: "POST", body: { recipe: recipe(), project: form.dataset.project, yaml: editor.value, overrides: overrideLines() } });
      if (mine === sequence) await show(result.errors);
    } catch (error) {
      if (mine !== sequence) return;
      if (error.status === 400 && error.data && error.data.errors) {  // the request itself was refused (e.g. too big)
        await show(error.data.errors.map((e) => ({ field: e.field === "yaml" ? "" : e.field, message: e.message, line: null })));
      } else {
        status.textContent = "Could not check the config just now; it is checked again when you launch.";
        status.className = "muted";
        invalid = false;
        setButton();
      }
    }
  }

  function schedule() {
    clearTimeout(timer);
    status.textContent = "Checking…";
    status.className = "muted";
    timer = setTimeout(validate, 300);
  }

  function showNewExperiment() {
    newBox.hidden = experiment.value !== "new";
    for (const option of preset.options) if (option.value) option.hidden = option.dataset.recipe !== recipe();
    showPresetNeeds();
  }

  // A preset that starts from the SFT demo's export, in a project without one, says so (and offers to make it).
  const needsSft = $("preset-needs-sft");
  function showPresetNeeds() {
    if (needsSft) needsSft.hidden = !needsSft.dataset.presets.split(" ").includes(preset.value);
  }

  function loadPreset(key) {
    const chosen = presets.find((p) => p.key === key);
    if (!chosen) return;
    editor.value = chosen.yaml;
    loadedText = chosen.yaml;
    // From a checkpoint: a preset replaces the parent's config, and with it the parent's own overrides.
    if (overrides.dataset.checkpointOverrides !== undefined) overrides.value = overrides.dataset.checkpointOverrides;
    drawGutter();
    schedule();
  }

  function recipeChanged() {
    showNewExperiment();
    const current = presets.find((p) => p.key === preset.value);
    if (editor.value === loadedText && (!current || current.recipe !== recipe())) {
      const first = presets.find((p) => p.recipe === recipe());
      if (first) { preset.value = first.key; loadPreset(first.key); showPresetNeeds(); return; }
    }
    schedule();
  }

  preset.addEventListener("change", () => {
    showPresetNeeds();
    if (!preset.value) return;
    if (editor.value !== loadedText && !window.confirm("Replace your edited config with this preset?")) return;
    loadPreset(preset.value);
  });
  experiment.addEventListener("change", recipeChanged);
  newRecipe.addEventListener("change", recipeChanged);
  editor.addEventListener("input", () => { drawGutter(); schedule(); });
  editor.addEventListener("scroll", () => { gutter.scrollTop = editor.scrollTop; });
  overrides.addEventListener("input", schedule);
  for (const box of form.querySelectorAll('input[name="hosts"]')) box.addEventListener("change", schedule);
  // Tab inserts two spaces in the editor (YAML indents with spaces); Escape then Tab leaves it.
  let escaped = false;
  editor.addEventListener("keydown", (e) => {
    if (e.key === "Escape") { escaped = true; return; }
    if (e.key === "Tab" && !e.shiftKey && !escaped) {
      e.preventDefault();
      editor.setRangeText("  ", editor.selectionStart, editor.selectionEnd, "end");
      editor.dispatchEvent(new Event("input"));
    }
    escaped = false;
  });
  // Clicking a problem puts the cursor on its line.
  errorList.addEventListener("click", (e) => {
    const li = e.target.closest("li[data-line]");
    if (!li) return;
    const lines = editor.value.split("\n"), n = Number(li.dataset.line);
    const start = lines.slice(0, n - 1).reduce((sum, l) => sum + l.length + 1, 0);
    editor.focus();
    editor.setSelectionRange(start, start + (lines[n - 1] || "").length);
  });
  form.addEventListener("submit", (e) => { if (invalid || !canLaunch) e.preventDefault(); });

  window.FBLaunch = { recipe, overrideLines, config: () => editor.value, project: form.dataset.project };
  showNewExperiment();
  drawGutter();
  setButton();
  if (canLaunch) validate();
})();
