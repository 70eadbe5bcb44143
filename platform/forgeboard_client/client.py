"""A small Python client for /api/v1 (what CI scripts and `forgeboard ci` use). Django-free."""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

import httpx

RETRY_PAUSES_S = (0.5, 2.0)  # before the second and third try of a keyed write
RETRY_STATUSES = {502, 503, 504}  # a proxy that lost the server: the write may or may not have happened


class ApiError(Exception):
    def __init__(self, status: int, body: dict[str, Any]):
        self.status, self.body = status, body
        fields = "; ".join(f"{e['field']}: {e['message']}" for e in body.get("errors", []))
        super().__init__(f"HTTP {status}: {body.get('message', '')}" + (f" ({fields})" if fields else ""))


class ForgeboardClient:
    def __init__(self, url: str, token: str, *, timeout_s: float = 30.0, transport: httpx.BaseTransport | None = None):
        self._http = httpx.Client(base_url=url.rstrip("/") + "/api/v1", timeout=timeout_s, transport=transport,
                                  headers={"Authorization": f"Bearer {token}"})

    @classmethod
    def from_environment(cls) -> ForgeboardClient:
        url, token = os.environ.get("FORGEBOARD_URL"), os.environ.get("FORGEBOARD_TOKEN")
        if not url or not token:
            raise ApiError(0, {"message": "set FORGEBOARD_URL and FORGEBOARD_TOKEN (or pass --url and --token)"})
        return cls(url, token)

    def _call(self, method: str, path: str, *, keyed: bool = False, **kwargs: Any) -> Any:
        """One request; a `keyed` write (one that creates something) carries an Idempotency-Key and is sent again,
        with the same key, when the connection fails or a gateway answers 502-504: the server creates it once."""
        if keyed:
            kwargs["headers"] = {**kwargs.get("headers", {}), "Idempotency-Key": str(uuid.uuid4())}
        attempts = len(RETRY_PAUSES_S) + 1 if keyed else 1
        for attempt in range(attempts):
            if attempt:
                time.sleep(RETRY_PAUSES_S[attempt - 1])
            try:
                response = self._http.request(method, path, **kwargs)
            except httpx.TransportError as exc:
                if attempt + 1 < attempts:
                    continue
                raise ApiError(0, {"message": f"cannot reach {self._http.base_url}: {exc}"}) from None
            if response.status_code not in RETRY_STATUSES or attempt + 1 == attempts:
                break
        try:
            body = response.json()
        except ValueError:
            body = {"message": response.text[:500]}
        if response.status_code >= 400:
            raise ApiError(response.status_code, body if isinstance(body, dict) else {"message": str(body)})
        return body

    def projects(self) -> list[dict]:
        return self._call("GET", "/projects")["items"]

    def launch_run(self, experiment_id: int, config_yaml: str, overrides: list[str] | None = None) -> dict:
        return self._call("POST", f"/experiments/{experiment_id}/runs",
                          json={"config_yaml": config_yaml, "overrides": overrides or []}, keyed=True)

    def run(self, run_id: int) -> dict:
        return self._call("GET", f"/runs/{run_id}")

    def create_suite(self, project: str, name: str, spec: dict, description: str = "") -> dict:
        return self._call("POST", f"/projects/{project}/suites",
                          json={"name": name, "spec": spec, "description": description}, keyed=True)

    def launch_suite(self, project: str, name: str) -> dict:
        return self._call("POST", f"/projects/{project}/suites/{name}/runs", keyed=True)

    def suite_run(self, suite_run_id: int) -> dict:
        return self._call("GET", f"/suite-runs/{suite_run_id}")

    def wait_suite_run(self, suite_run_id: int, *, timeout_s: float, poll_s: float = 2.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            result = self.suite_run(suite_run_id)
            if result["verdict"] != "running" or time.monotonic() > deadline:
                return result
            time.sleep(poll_s)

    def close(self) -> None:
        self._http.close()
