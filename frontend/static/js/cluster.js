// The cluster page refreshes its host list every 15 s, unless an operator is filling in a state form.
(function () {
  "use strict";
  const REFRESH_MS = 15000;
  const hosts = document.getElementById("hosts");
  const updated = document.getElementById("cluster-updated");
  if (!hosts) return;

  function busy() {
    const active = document.activeElement;
    if (active && hosts.contains(active) && active.closest("form")) return true;
    return Array.from(hosts.querySelectorAll('input[name="reason"]')).some((input) => input.value.trim() !== "");
  }

  async function refresh() {
    if (document.hidden || busy()) return;
    try {
      const response = await fetch(window.location.pathname, { credentials: "same-origin" });
      if (!response.ok) throw new Error(response.statusText);
      const page = new DOMParser().parseFromString(await response.text(), "text/html");
      const fresh = page.getElementById("hosts");
      if (fresh && !busy()) {
        hosts.replaceChildren(...fresh.childNodes);
        updated.textContent = "updated " + new Date().toLocaleTimeString();
      }
    } catch (error) {
      updated.textContent = "could not refresh: " + error.message;
    }
  }

  setInterval(refresh, REFRESH_MS);
})();
