// A run's events in words, for the run page's event list: one describer per event kind and, for the engine's
// "message" events, one per message name. A payload of a shape no describer expects reads as its JSON.
window.FBEventText = (function () {
  "use strict";
  const number = (v) => (v === null || v === undefined || v === "" || !isFinite(Number(v)) ? null : Number(v));
  const seconds = (v) => `${Number(v).toFixed(v > 0 && v < 0.1 ? 2 : 1)} s`;  // 0.03 s, 0.1 s, 12.4 s
  const payloadText = (payload) => {  // an event's payload as its JSON, cut at 160 characters
    const text = JSON.stringify(payload) || "";
    return text.length > 160 ? text.slice(0, 157) + "…" : text;
  };
  const listOf = (v) => (Array.isArray(v) ? v : v === null || v === undefined ? [] : [v]);
  const objectOf = (v) => (v && typeof v === "object" && !Array.isArray(v) ? v : {});
  const plural = (n, one, many = one + "s") => `${n} ${Number(n) === 1 ? one : many}`;
  const who = (p) => `${p.role || ""}${p.replica != null ? " " + p.replica : ""}`.trim() || "run";
  const quoted = (text) => JSON.stringify(String(text ?? "").slice(0, 80));

  const BY_MESSAGE_NAME = {
    startup_phase: (p) => (p.phase === "ready" ? `ready: started in ${seconds(number(p.elapsed_s) ?? 0)}`
      : `${p.label || p.phase} (at ${seconds(number(p.elapsed_s) ?? 0)}` +
        `${number(p.previous_s) !== null ? `; the previous phase took ${seconds(number(p.previous_s))}` : ""})`),
    child_run_started: (p) => `started ${p.experiment} #${p.number} from step ${p.step}`,
    child_run_failed: (p) => `no run started from step ${p.step}: ${p.reason}`,
    checkpoint_export: (p) => `export of step ${p.step}: ${String(p.summary || p.state).slice(0, 200)}`,
    job_submitted: (p) => `submitted as ${p.backend} job ${p.job_id}`,
    job_status: (p) => {
      const down = Object.entries(objectOf(p.nodes_down)).map(([node, why]) => `${node} (${why})`);
      return `${String(p.backend).toUpperCase()} job ${p.job_id}: ${p.reason}` +
        (down.length ? `; node${down.length > 1 ? "s" : ""} down: ${down.join(", ")}` : "");
    },
    dataset: (p) => {
      const from = p.source && p.source !== p.task ? ` (${p.source})` : "";
      return `data ${p.task}${from}: ${plural(p.train, "training problem")}, ${p.held_out} held out` +
        (p.unused ? `, ${p.unused} of ${p.rows} rows unused` : "");
    },
    meshes_ready: (p) => {
      const hosts = listOf(p.trainer_hosts ?? p.trainer_host).filter(Boolean).join(", ");
      const generators = p.generator_replicas === undefined ? ""
        : p.generator_replicas === 0 ? "; the trainer generates"
        : `; ${plural(p.generator_replicas, "generator replica")}`;
      return `procs ready in ${seconds(number(p.seconds) ?? 0)}: ${plural(p.trainer_ranks, "trainer rank")}` +
        `${hosts ? " on " + hosts : ""}${generators}${p.warm_spares ? `; ${plural(p.warm_spares, "warm spare")}` : ""}`;
    },
    staleness_histogram: (p) => {
      const ages = Object.entries(objectOf(p.counts))
        .map(([age, n]) => `${plural(n, "batch", "batches")} ${plural(age, "step")} behind`);
      return `policy age of the trained batches: ${ages.join(", ") || "none trained"}`;
    },
    resumed: (p) => `resumed from ${p.path} at step ${p.step}` +
      `${p.policy_version != null ? `, policy version ${p.policy_version}` : ""}`,
    spares_started: (p) => `starting ${plural(p.count, "warm spare")} for ${p.role} on ${p.host}`,
    spare_ready: (p) => `a warm spare for ${p.role} is ready on ${p.host}`,
  };

  const BY_KIND = {
    state_changed: (p) => `${p.from || "—"} → ${p.to}${p.reason ? ": " + p.reason : ""}`,
    fault_injected: (p) => `${p.fault_kind || p.kind || "fault"} on ${who(p)}${p.duration_s ? ` for ${p.duration_s} s` : ""}`,
    failure_detected: (p) => `${who(p)}${p.hung ? " hung" : " failed"}` +
      `${p.time_to_detect_s != null ? ` (detected in ${Number(p.time_to_detect_s).toFixed(2)} s)` : ""}` +
      `${p.reason ? ": " + p.reason.slice(0, 120) : ""}`,
    replica_replaced: (p) => `${who(p)} replaced${p.from_spare ? " by a warm spare" : ""}${p.host ? " on " + p.host : ""}` +
      `${p.policy_version != null ? `, at policy version ${p.policy_version}` : ""}`,
    recovered: (p) => `recovered ${who(p)}${p.time_to_recover_s != null ? ` in ${Number(p.time_to_recover_s).toFixed(2)} s` : ""}`,
    placement_changed: (p) => `${p.action || "change"} ${who(p)}${p.host ? " → " + p.host : ""}`,
    redirect_started: (p) => `${p.action || "redirect"} host ${p.host || ""}`,
    redirect_finished: (p) => `${p.action || "redirect"} host ${p.host || ""}`,
    restarted: (p) => `restart ${p.restart || p.count || ""}${p.from_checkpoint ? " from " + p.from_checkpoint : ""}`,
    command_issued: (p) => `command ${p.command}: ${p.kind}`,
    command_finished: (p) => {
      const why = p.result && (p.result.error || p.result.reason);
      const outcome = p.state === "expired" ? "expired" : p.ok === false ? "failed" : "done";
      return `command ${p.command} (${p.kind}) ${outcome}${why ? ": " + why : ""}` +
        `${p.late ? ` (reported after it had expired: ${p.late})` : ""}`;
    },
    checkpoint_saved: (p) => `checkpoint at step ${p.step}`,
    message: (p) => {
      if (Object.hasOwn(BY_MESSAGE_NAME, p.name)) return BY_MESSAGE_NAME[p.name](p);
      return p.text && !p.name ? p.text : payloadText(p);
    },
    rollout: (p) => `step ${p.step}${p.split && p.split !== "train" ? ` (${p.split})` : ""}` +
      `${p.policy_version != null ? `, policy version ${p.policy_version}` : ""}: ${quoted(p.prompt)} → ` +
      `${quoted(p.completion)}, reward ${p.reward}`,
    placement_applied: (p) => {
      const plan = Object.entries(objectOf(p.plan)).map(([index, host]) => `${index} on ${host}`);
      return `${p.role} placed: ${plan.join(", ") || listOf(p.hosts).join(", ")}`;
    },
  };

  function describe(event) {  // never throws: a describer that fails on an odd payload gives way to its JSON
    const payload = event.payload ?? null;
    try {
      const describer = Object.hasOwn(BY_KIND, event.kind) ? BY_KIND[event.kind] : payloadText;
      return describer(payload || {});
    } catch (error) {
      return payloadText(payload);
    }
  }

  return { describe, number, seconds };
})();
