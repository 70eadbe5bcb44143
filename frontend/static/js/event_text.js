// A run's events in words, for the run page's event list: one describer per event kind and, for the "message" events
// (the engine's, and the control plane's: a job's scheduler, the reconciler, checkpoint exports), one per message
// name. A payload of a shape no describer expects reads as its JSON: a describer reads each fact it says through
// `value` or `text`, which throw on a fact that is missing or not text, so no description says "undefined".
window.FBEventText = (function () {
  "use strict";
  const MAX_VALUE_CHARS = 240;  // one fact of a payload, in words
  const MAX_DESCRIPTION_CHARS = 600;
  const number = (v) => (v === null || v === undefined || v === "" || !isFinite(Number(v)) ? null : Number(v));
  const seconds = (v) => `${Number(v).toFixed(v > 0 && v < 0.1 ? 2 : 1)} s`;  // 0.03 s, 0.1 s, 12.4 s
  const clip = (s, max) => (s.length > max ? s.slice(0, max - 1) + "…" : s);
  const payloadText = (payload) => {  // an event's payload as its JSON, cut at 160 characters
    const json = JSON.stringify(payload) || "";
    return json.length > 160 ? json.slice(0, 157) + "…" : json;
  };
  // A fact to say: text (cut short) or a finite number; anything else (missing, null, an object) throws.
  const value = (v, max = MAX_VALUE_CHARS) => {
    if (typeof v === "string") return clip(v, max);
    if (typeof v === "number" && isFinite(v)) return String(v);
    throw new TypeError(`not a fact to say: ${JSON.stringify(v)}`);
  };
  const text = (v, max = MAX_VALUE_CHARS) => {  // words only (a reason, a problem): a number there is no reason
    if (typeof v !== "string") throw new TypeError(`not text: ${JSON.stringify(v)}`);
    return clip(v, max);
  };
  const given = (v) => v !== null && v !== undefined && v !== "";
  const optional = (v, say) => (given(v) ? say(value(v)) : "");  // "" when the fact is not there
  const listOf = (v) => (Array.isArray(v) ? v : v === null || v === undefined ? [] : [v]);
  const objectOf = (v) => (v && typeof v === "object" && !Array.isArray(v) ? v : {});
  const plural = (n, one, many = one + "s") => `${value(n)} ${Number(n) === 1 ? one : many}`;
  const who = (p) => `${given(p.role) ? value(p.role) : ""}${given(p.replica) ? " " + value(p.replica) : ""}`.trim() || "run";
  const quoted = (v) => JSON.stringify(value(v, 80));
  const SECTIONS = { metrics: "metric point", events: "event", logs: "log line", batches: "empty batch" };

  const BY_MESSAGE_NAME = {
    startup_phase: (p) => (p.phase === "ready" ? `ready: started in ${seconds(number(p.elapsed_s) ?? 0)}`
      : `${value(p.label || p.phase)} (at ${seconds(number(p.elapsed_s) ?? 0)}` +
        `${number(p.previous_s) !== null ? `; the previous phase took ${seconds(number(p.previous_s))}` : ""})`),
    child_run_started: (p) => `started ${value(p.experiment)} #${value(p.number)} from step ${value(p.step)}`,
    child_run_failed: (p) => `no run started from step ${value(p.step)}: ${text(p.reason)}`,
    checkpoint_export: (p) => `export of step ${value(p.step)}: ${value(p.summary || p.state, 200)}`,
    job_submitted: (p) => `submitted as ${value(p.backend)} job ${value(p.job_id)}${optional(p.found, (f) => ` (${f})`)}` +
      optional(p.checkpoints, (c) => `; ${c}`),
    job_status: (p) => {
      const down = Object.entries(objectOf(p.nodes_down)).map(([node, why]) => `${clip(node, 80)} (${value(why)})`);
      return `${value(p.backend).toUpperCase()} job ${value(p.job_id)}: ${value(p.reason)}` +
        (down.length ? `; node${down.length > 1 ? "s" : ""} down: ${down.join(", ")}` : "");
    },
    dataset: (p) => {
      const from = given(p.source) && p.source !== p.task ? ` (${value(p.source)})` : "";
      return `data ${value(p.task)}${from}: ${plural(p.train, "training problem")}, ${value(p.held_out)} held out` +
        (p.unused ? `, ${value(p.unused)} of ${value(p.rows)} rows unused` : "");
    },
    meshes_ready: (p) => {
      const hosts = listOf(p.trainer_hosts ?? p.trainer_host).filter(given).map((host) => value(host)).join(", ");
      const replicas = number(p.generator_replicas);
      const generators = replicas === null ? "" : replicas === 0 ? "; the trainer generates"
        : `; ${plural(replicas, "generator replica")}`;
      return `procs ready in ${seconds(number(p.seconds) ?? 0)}: ${plural(p.trainer_ranks, "trainer rank")}` +
        `${hosts ? " on " + hosts : ""}${generators}${number(p.warm_spares) ? `; ${plural(p.warm_spares, "warm spare")}` : ""}`;
    },
    staleness_histogram: (p) => {
      const ages = Object.entries(objectOf(p.counts))
        .map(([age, n]) => `${plural(n, "batch", "batches")} ${plural(clip(age, 20), "step")} behind`);
      return `policy age of the trained batches: ${ages.join(", ") || "none trained"}`;
    },
    resumed: (p) => {  // the optimizer settings the checkpoint's state brought over the config's (checkpoint.py)
      const setting = (v) => (Array.isArray(v) ? `[${v.map((item) => value(item)).join(", ")}]` : value(v));
      const settings = listOf(p.optimizer_from_checkpoint).map((d) =>
        `${value(d.setting)} ${setting(d.checkpoint)} (the config says ${setting(d.config)})`);
      return `resumed from ${value(p.path)} at step ${value(p.step)}` +
        optional(p.policy_version, (v) => `, policy version ${v}`) +
        (settings.length ? `; the checkpoint's optimizer settings: ${settings.join(", ")}` : "");
    },
    spares_started: (p) => `starting ${plural(p.count, "warm spare")} for ${value(p.role)} on ${value(p.host)}`,
    spare_ready: (p) => `a warm spare for ${value(p.role)} is ready on ${value(p.host)}`,
    // The reconciler's, about what a lost (or failed) run's previous attempt left: its job, or its engine.
    previous_attempt_stopped: (p) => `previous attempt confirmed stopped: ${text(p.detail)}`,
    previous_attempt_not_stopped: (p) => `previous attempt not confirmed stopped — ${text(p.attempt)}: ${text(p.problem)}`,
    previous_attempt_not_confirmed: (p) => `previous attempt given up on: ` +
      (given(p.problem) ? text(p.problem) : `${text(p.left)} may still be running; stopping it is left to an operator`),
    // The engine's telemetry client, for items the control plane refused (or a duplicate it dropped): lost for good.
    telemetry_dropped: (p) => {
      const sections = Object.entries(objectOf(p.by_section))
        .map(([section, n]) => plural(n, Object.hasOwn(SECTIONS, section) ? SECTIONS[section] : clip(section, 40)));
      const reasons = listOf(p.reasons).filter(given);
      const why = reasons.length ? ` (${text(reasons[0])}${reasons.length > 1 ? `; ${reasons.length - 1} more` : ""})` : "";
      return `telemetry dropped: ${sections.length ? sections.join(", ") : plural(p.items, "item")} of batch ` +
        `${value(p.seq)}${why}; ${plural(p.total, "item")} dropped so far`;
    },
    // The same client, for a spool whose count of dropped items could not be read: it counts again from 0.
    telemetry_dropped_count_lost: (p) => `telemetry dropped count lost: ${text(p.reason)}`,
  };

  const BY_KIND = {
    state_changed: (p) => `${given(p.from) ? value(p.from) : "—"} → ${value(p.to)}${optional(p.reason, (r) => ": " + r)}`,
    fault_injected: (p) => `${value(p.fault_kind || p.kind || "fault")} on ${who(p)}` +
      (p.fault_kind === "nan_gradients" ? ": its next update is skipped" : "") +
      `${number(p.duration_s) ? ` for ${number(p.duration_s)} s` : ""}`,
    failure_detected: (p) => `${who(p)}${p.hung ? " hung" : " failed"}${optional(p.host, (h) => " on " + h)}` +
      `${number(p.time_to_detect_s) !== null ? ` (detected in ${number(p.time_to_detect_s).toFixed(2)} s)` : ""}` +
      `${p.reason ? ": " + text(p.reason, 120) : ""}`,
    replica_replaced: (p) => `${who(p)} replaced${p.from_spare ? " by a warm spare" : ""}` +
      `${optional(p.host, (h) => " on " + h)}${optional(p.policy_version, (v) => `, at policy version ${v}`)}`,
    recovered: (p) => `recovered ${who(p)}` +
      `${number(p.time_to_recover_s) !== null ? ` in ${number(p.time_to_recover_s).toFixed(2)} s` : ""}` +
      `${number(p.skipped_updates) !== null ? `, after ${plural(p.skipped_updates, "skipped update")}` : ""}`,
    placement_changed: (p) => `${given(p.action) ? value(p.action) : "change"} ${who(p)}${optional(p.host, (h) => " → " + h)}`,
    redirect_started: (p) => {
      const moving = [...listOf(p.replicas).map((r) => `generator replica ${value(r)}`),
        ...listOf(p.trainer_ranks).map((r) => `trainer rank ${value(r)}`)];
      return `${given(p.action) ? value(p.action) : "redirect"} host ${value(p.host)}` +
        (moving.length ? `: moving ${moving.join(", ")}${optional(p.moves_at, (at) => " at " + at)}` : "");
    },
    redirect_finished: (p) => {
      const moved = Object.entries(objectOf(p.moved)).map(([r, host]) => `generator replica ${clip(r, 20)} → ${value(host)}`);
      return `${given(p.action) ? value(p.action) : "redirect"} host ${value(p.host)} done` +
        `${number(p.seconds) !== null ? ` in ${seconds(number(p.seconds))}` : ""}` +
        (p.in_recovery === true ? " as the trainer recovered" : "") + (moved.length ? `: ${moved.join(", ")}` : "");
    },
    // The reconciler's: why is the state change's just before it ("lost → queued: restart 1 of 2: no heartbeat …").
    restarted: (p) => {
      const restart = `restart ${value(p.restart ?? p.count)}${optional(p.of, (n) => ` of ${n}`)}`;
      return (given(p.attempt) ? `attempt ${value(p.attempt)} queued (${restart})` : restart) +
        optional(p.from_checkpoint, (c) => " from " + c) +
        (given(p.stopped) ? ` after stopping ${text(p.stopped)}` : "") +
        (given(p.not_stopped) ? ` without stopping ${text(p.not_stopped)}` : "");
    },
    command_issued: (p) => `command ${value(p.command)}: ${value(p.kind)}${optional(p.by, (by) => ` from ${by}`)}`,
    command_acknowledged: (p) => `command ${value(p.command)} taken by the run's controller`,
    command_finished: (p) => {
      const result = objectOf(p.result);
      const why = given(result.error) ? result.error : result.reason;
      const outcome = p.state === "expired" ? "expired" : p.ok === false ? "failed" : "done";
      return `command ${value(p.command)} (${value(p.kind)}) ${outcome}${given(why) ? ": " + text(why) : ""}` +
        `${optional(p.late, (late) => ` (reported after it had expired: ${late})`)}`;
    },
    checkpoint_saved: (p) => `checkpoint at step ${value(p.step)}`,
    eval: (p) => {  // no shape of its own: its figures
      const figures = Object.entries(p).filter(([key, v]) => key !== "step" && typeof v === "number" && isFinite(v))
        .map(([key, v]) => `${clip(key, 40)} ${Number(v.toPrecision(4))}`);
      if (!figures.length) throw new TypeError("no figures");
      return `evaluation${optional(p.step, (s) => ` at step ${s}`)}: ${figures.join(", ")}`;
    },
    message: (p) => {
      if (Object.hasOwn(BY_MESSAGE_NAME, p.name)) return BY_MESSAGE_NAME[p.name](p);
      return typeof p.text === "string" && p.text && !p.name ? clip(p.text, MAX_DESCRIPTION_CHARS) : payloadText(p);
    },
    rollout: (p) => `step ${value(p.step)}${given(p.split) && p.split !== "train" ? ` (${value(p.split)})` : ""}` +
      `${optional(p.policy_version, (v) => `, policy version ${v}`)}: ${quoted(p.prompt)} → ` +
      `${quoted(p.completion)}, reward ${value(p.reward)}`,
    placement_applied: (p) => {
      const plan = Object.entries(objectOf(p.plan)).map(([index, host]) => `${clip(index, 20)} on ${value(host)}`);
      return `${value(p.role)} placed: ${plan.join(", ") || listOf(p.hosts).map((host) => value(host)).join(", ")}`;
    },
  };

  function describe(event) {  // never throws: a describer that fails on an odd payload gives way to its JSON
    let payload = null;
    try {
      payload = event.payload ?? null;
      const describer = Object.hasOwn(BY_KIND, event.kind) ? BY_KIND[event.kind] : payloadText;
      const said = describer(payload || {});
      return typeof said === "string" && said ? clip(said, MAX_DESCRIPTION_CHARS) : payloadText(payload);
    } catch (error) {
      return payloadText(payload);
    }
  }

  // What has words: the event kinds and message names (the test suite checks that every one the code emits does).
  const kinds = Object.freeze(Object.keys(BY_KIND));
  const messageNames = Object.freeze(Object.keys(BY_MESSAGE_NAME));
  return { describe, number, seconds, kinds, messageNames };
})();
