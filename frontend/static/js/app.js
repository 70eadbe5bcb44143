// Small helpers every page uses: CSRF for fetch and htmx, and confirmation of operator actions.
(function () {
  "use strict";
  const csrf = () => document.querySelector('meta[name="csrf-token"]').content;

  document.addEventListener("htmx:configRequest", (e) => { e.detail.headers["X-CSRFToken"] = csrf(); });

  // <form data-confirm="Really?">: asks before submitting (operator controls, cancel).
  document.addEventListener("submit", (e) => {
    const message = e.target.dataset && e.target.dataset.confirm;
    if (message && !window.confirm(message)) e.preventDefault();
  }, true);

  async function api(path, { method = "GET", body = null } = {}) {
    const response = await fetch(path, {
      method, credentials: "same-origin",
      headers: { "Content-Type": "application/json", "X-CSRFToken": csrf() },
      body: body === null ? null : JSON.stringify(body),
    });
    const data = await response.json().catch(() => ({}));
    if (!response.ok) throw Object.assign(new Error(data.message || response.statusText), { data, status: response.status });
    return data;
  }

  window.FB = { csrf, api };
})();
