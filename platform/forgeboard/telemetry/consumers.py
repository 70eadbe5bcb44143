"""Websocket streams. `/ws/runs/<id>/?after_seq=N&after_step=S&after_batch=B&after_line=L`: what was missed, then live
updates.

A client that reconnects sends the last event sequence, metric step and log line it saw (the line `L` of telemetry
batch `B`; without `after_line`, all of batch `B`); the backlog comes from the database, so nothing is lost across
reconnects or web processes. The backlog is the run as of the moment it is read: a `run.backlog` frame (state, metrics
from step S on, the log tail after the client's line, timelines, the telemetry batch it goes to as `telemetry_seq`, and
the first events after N) and, while its `more` is true, `run.backlog_page` frames with the following events, until
every event up to that moment is sent; live updates follow. Each frame holds at most BACKLOG_PAGE_EVENTS events and
stops at BACKLOG_PAGE_CHARS of them. Its log tail is the last BACKLOG_LOG_LINES lines for a page that has none, and for
one that resumes, the lines after its own, as many as it keeps (MISSED_LOG_LINES).

The channel layer is best effort (it drops an update for a subscriber that is behind, and one may come
late), so each stream follows what it sent. Events arrive once and in order: a live update that
repeats what a frame sent loses those events, and one that finds events missing before its own is
preceded by them, from the database. Telemetry likewise: an update that finds batches missing before
its own (or, for the platform's events, before the run's last) is preceded by a `run.update` frame
with what they held, from the database (metrics from the last step sent, their log lines, timelines;
its `telemetry_seq` is the batch it goes to), and a batch's update that comes after that loses its
metrics, log lines and timelines.

Log lines come in frames of at most LOG_FRAME_CHARS of JSON each (one longer line goes alone): a frame's lines that
do not fit are sent before it, in frames of their own with nothing else, each saying where its last line is
(`logs_through`: its `batch` and `line`). A live update carries its batch's last lines (telemetry/ingest.py) and says
how many it leaves out before them (`logs_left_out`): the stream sends those first, from the database, as many as the
run page keeps (MISSED_LOG_LINES) with the lines that follow. A page whose connection drops between those frames and
the frame they go with resumes after the last line it has: no line twice.

Authenticated by the session cookie, or by `?token=` with an API token of the run's project. A stream
stays open only while its credential may read the project: it is closed (4403) when the token is revoked
or the member removed, at once, and within STREAM_ACCESS_RECHECK_S when the token expires, the user is
deactivated, or the browser's session ends (logged out, expired, the password changed).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from importlib import import_module
from urllib.parse import parse_qs

from channels.consumer import get_handler_name
from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer, AsyncWebsocketConsumer
from django.conf import settings
from django.contrib.auth import get_user
from django.contrib.auth.base_user import AbstractBaseUser
from django.contrib.auth.models import AnonymousUser
from django.http import HttpRequest

from forgeboard.accounts.models import ApiToken, Project
from forgeboard.accounts.permissions import project_role
from forgeboard.accounts.services import api_token_authenticate
from forgeboard.runs.models import Run
from forgeboard.stream_limits import CLIENT_FRAME_MAX_CHARS
from forgeboard.telemetry.ingest import WIRE_LOG_CHARS, wire_number
from forgeboard.telemetry.selectors import (
    Bucket,
    LoggedLine,
    events_page,
    log_tail,
    metrics_from_step,
    step_timelines,
)
from forgeboard.telemetry.streams import actor_group, project_group, run_group

BACKLOG_PAGE_EVENTS = 1_000
BACKLOG_PAGE_CHARS = 1_000_000
BACKLOG_POINTS_PER_KEY = 500
BACKLOG_LOG_LINES = 200
BACKLOG_TIMELINES = 50
MISSED_LOG_LINES = 500  # as many as the run page keeps
LOG_FRAME_CHARS = WIRE_LOG_CHARS
CLOSE_UNAUTHORIZED = 4401
CLOSE_ACCESS_WITHDRAWN = 4403
CLOSE_NOT_FOUND = 4404
CLOSE_BAD_REQUEST = 4400
MAX_CURSOR = 2**63 - 1  # the database's largest integer


@database_sync_to_async
def _actor_for(scope: dict, query: dict[str, list[str]]):
    user = scope.get("user")
    if user is not None and user.is_authenticated:
        return user
    raw = query.get("token", [""])[0]
    return api_token_authenticate(raw=raw) if raw else None


class LiveConsumer(AsyncJsonWebsocketConsumer):
    """Live updates go straight to their handler.

    Channels closes stale database connections before every handler it dispatches: a hop to the one
    shared sync thread, per message and per subscriber, that made a fan-out to 100 clients wait in
    line there. The update handlers touch no database; the reads that do go through
    `database_sync_to_async`, which closes its connections itself.
    """

    live_types: frozenset[str] = frozenset()

    async def dispatch(self, message: dict) -> None:
        if message["type"] in self.live_types:
            await getattr(self, get_handler_name(message))(message)
            return
        await super().dispatch(message)

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None, **kwargs) -> None:
        """A frame that is binary, oversized or not JSON is ignored: the stream goes on."""
        if not text_data or len(text_data) > CLIENT_FRAME_MAX_CHARS:
            return
        try:
            content = await self.decode_json(text_data)
        except (ValueError, RecursionError):  # not JSON, or nested deeper than the parser goes
            return
        await self.receive_json(content)

    async def receive_json(self, content, **kwargs) -> None:  # noqa: ANN001
        """A client's one message: a ping, answered with a pong."""
        if isinstance(content, dict) and content.get("type") == "ping":
            await self.send_json({"type": "pong"})

    async def follow_access(self, *, actor, project_id: int) -> None:  # noqa: ANN001 - a User or an ApiToken
        """Once accepted: close the stream when its credential may no longer read the project (told at once by
        streams.publish_access_withdrawn, and checked every STREAM_ACCESS_RECHECK_S besides)."""
        self.actor, self.project_id = actor, project_id
        self.actor_group = actor_group(kind="token" if isinstance(actor, ApiToken) else "user", pk=actor.pk)
        await self.channel_layer.group_add(self.actor_group, self.channel_name)
        self.access_rechecks = asyncio.create_task(self._check_access_every(settings.STREAM_ACCESS_RECHECK_S))

    async def stop_following_access(self) -> None:
        if hasattr(self, "actor_group"):
            self.access_rechecks.cancel()
            await self.channel_layer.group_discard(self.actor_group, self.channel_name)

    async def access_check(self, message: dict) -> bool:
        """Whether the stream may go on; closed if not."""
        if await self._may_still_read():
            return True
        await self.close(code=CLOSE_ACCESS_WITHDRAWN)
        return False

    async def _check_access_every(self, seconds: int) -> None:
        while True:
            await asyncio.sleep(seconds)
            if not await self.access_check({}):
                return

    @database_sync_to_async
    def _may_still_read(self) -> bool:
        """The credential as the database has it now: a token revoked or expired since, or a user deactivated,
        removed, or logged out (the session ended, expired, or went stale with a password change) reads nothing."""
        if isinstance(self.actor, ApiToken):
            current = ApiToken.objects.select_related("created_by").filter(pk=self.actor.pk).first()
        else:
            current = _logged_in_user(self.scope["session"].session_key)
        project = Project.objects.filter(pk=self.project_id).first()
        if current != self.actor or project is None:  # None, or anonymous: gone
            return False
        return project_role(actor=current, project=project) is not None


def _logged_in_user(session_key: str | None) -> AbstractBaseUser | AnonymousUser:
    """Whom a session is logged in as now, found as a request's would be (anonymous once it is not)."""
    request = HttpRequest()
    request.session = import_module(settings.SESSION_ENGINE).SessionStore(session_key)
    return get_user(request)


class UnknownPathConsumer(AsyncWebsocketConsumer):
    """The last route: a path that matches no stream is refused like a stream that is not there."""

    async def connect(self) -> None:
        await self.close(code=CLOSE_NOT_FOUND)


def _cursor(query: dict[str, list[str]], name: str) -> int | None:
    """A cursor's value from the query, 0 when it is left out; None when it is not a whole number the database can hold
    (only ASCII digits: no sign, space, underscore or other script's digit, which int() would take)."""
    values = query.get(name)
    if not values:
        return 0
    text = values[0]
    if not (text.isascii() and text.isdigit() and len(text) <= len(str(MAX_CURSOR))) or int(text) > MAX_CURSOR:
        return None
    return int(text)


@dataclass(frozen=True)
class ResumePoint:
    """Where a page's stream starts (its query): after the event `seq`, from the metric step `step` (a step's metrics
    may come in several batches), and after the log line `line` of telemetry batch `batch`, or all of that batch when
    `line` is None. A fresh page's are all 0; a page cannot skip or see another run's data with them, only leave out
    lines of its own that it says it has."""

    seq: int
    step: int
    batch: int
    line: int | None

    @classmethod
    def from_query(cls, query: dict[str, list[str]]) -> ResumePoint | None:
        """None when a cursor is not a whole number from 0 to 2**63 - 1 (the stream is refused)."""
        cursors = {name: _cursor(query, name) for name in ("after_seq", "after_step", "after_batch", "after_line")}
        if None in cursors.values():
            return None
        return cls(seq=cursors["after_seq"], step=cursors["after_step"], batch=cursors["after_batch"],
                   line=cursors["after_line"] if "after_line" in query else None)

    @property
    def resumes(self) -> bool:
        """Whether the page has some of the run's log already (its backlog's lines go on from there)."""
        return self.batch > 0 or self.line is not None


@dataclass
class Seen:
    """What a stream's subscriber has of its run so far: the last event, the last metric step and the last telemetry
    batch (its metrics, log lines and timelines) it was sent. Each only moves on from where the backlog left it."""

    seq: int
    step: int
    batch: int

    def saw_events(self, events: list[dict]) -> None:
        if events:
            self.seq = max(self.seq, events[-1]["seq"])

    def saw_metrics(self, metrics: dict[str, list[list]]) -> None:
        self.step = max([self.step, *(points[-1][0] for points in metrics.values() if points)])

    def saw_batch(self, batch: int, *, last_step: int | None) -> None:
        self.batch = max(self.batch, batch)
        if last_step is not None:
            self.step = max(self.step, last_step)

    def is_new_batch(self, batch: int | None) -> bool:
        return batch is not None and batch > self.batch


@dataclass(frozen=True)
class LiveUpdate:
    """A run's update as it comes through the channel layer (streams.publish_run_update)."""

    update: dict
    text: str | None  # the update, encoded once for every subscriber
    first_seq: int | None  # of its first event (None: it has none)
    last_step: int | None  # of its metrics
    batch: int | None  # its telemetry batch (None: the platform's events)
    telemetry_seq: int | None  # the run's last batch as of this update

    @classmethod
    def from_message(cls, message: dict) -> LiveUpdate:
        update = message["update"]
        return cls(update=update, text=message.get("text"), first_seq=message.get("min_seq"),
                   last_step=message.get("last_step"), batch=update.get("batch"),
                   telemetry_seq=message.get("telemetry_seq"))

    @property
    def stored_before(self) -> int | None:
        """The last batch the run had stored before this update's own: all of those are in the database."""
        return self.batch - 1 if self.batch is not None else self.telemetry_seq


class RunStreamConsumer(LiveConsumer):
    live_types = frozenset({"run.update"})

    async def connect(self) -> None:
        query = parse_qs(self.scope["query_string"].decode(errors="replace"))
        start = ResumePoint.from_query(query)
        if start is None:
            await self.close(code=CLOSE_BAD_REQUEST)
            return
        actor = await _actor_for(self.scope, query)
        if actor is None:
            await self.close(code=CLOSE_UNAUTHORIZED)
            return
        run_id = self.scope["url_route"]["kwargs"]["run_id"]
        if not await self._may_read(actor, run_id):
            await self.close(code=CLOSE_NOT_FOUND)
            return
        self.run_id = run_id
        # Join first, then read the backlog: anything published in between arrives twice and is deduplicated.
        await self.channel_layer.group_add(run_group(self.run_id), self.channel_name)
        await self.accept()
        await self.follow_access(actor=actor, project_id=self.project_id)
        backlog, lines, through_seq = await self._backlog(start)
        self.seen = Seen(seq=start.seq, step=start.step, batch=backlog["telemetry_seq"])
        self.seen.saw_metrics(backlog["metrics"])
        backlog["logs"] = await self._send_all_but_last_log_page(lines)
        await self._send_events(through_seq=through_seq, first=backlog,
                                rest={"type": "run.backlog_page", "run": self.run_id})

    async def disconnect(self, code: int) -> None:
        await self.stop_following_access()
        if hasattr(self, "run_id"):
            await self.channel_layer.group_discard(run_group(self.run_id), self.channel_name)

    async def run_update(self, message: dict) -> None:
        """A live update: first what the subscriber misses before it (lost or late updates: from the database) and the
        lines its batch leaves out, then the update itself, without what the subscriber has already."""
        live = LiveUpdate.from_message(message)
        await self._send_missed_events(before=live)
        await self._send_missed_batches(before=live)
        new_batch = self.seen.is_new_batch(live.batch)
        if new_batch:
            await self._send_logs_left_out(of=live)
            self.seen.saw_batch(live.batch, last_step=live.last_step)
        await self._send_unsent_part(of=live, new_batch=new_batch)

    async def _send_missed_events(self, *, before: LiveUpdate) -> None:
        """The events between the last one sent and the update's first."""
        if before.first_seq is not None and before.first_seq > self.seen.seq + 1:
            await self._send_events(through_seq=before.first_seq - 1, first=self._empty_update(),
                                    rest=self._empty_update())

    async def _send_missed_batches(self, *, before: LiveUpdate) -> None:
        """What the batches between the last one sent and the update's (the run's last, for the platform's events) held,
        and, when the update has no events to tell of theirs, the events of the run as it was read with them."""
        if before.stored_before is None or before.stored_before <= self.seen.batch:
            return
        through_seq = await self._send_telemetry(through_batch=before.stored_before)
        if before.first_seq is None and through_seq > self.seen.seq:
            await self._send_events(through_seq=through_seq, first=self._empty_update(), rest=self._empty_update())

    async def _send_logs_left_out(self, *, of: LiveUpdate) -> None:
        """The first lines of the update's batch, which it leaves out (a long batch), from the database: as many as the
        run page keeps with the lines the update carries."""
        left_out, carried = of.update.get("logs_left_out") or 0, len(of.update.get("logs", []))
        if not left_out or carried >= MISSED_LOG_LINES:
            return
        lines = await database_sync_to_async(log_tail)(run_id=self.run_id, after_batch=of.batch - 1,
                                                       through_batch=of.batch, before_index=left_out,
                                                       last=MISSED_LOG_LINES - carried)
        for page in _log_pages(lines):
            await self.send_json(self._logs_frame(page))

    async def _send_unsent_part(self, *, of: LiveUpdate, new_batch: bool) -> None:
        """The update without what the subscriber has (events up to the last one sent; a batch sent from the database):
        as it was encoded for every subscriber when it has nothing to leave out, which keeps a fan-out cheap."""
        events_sent = of.first_seq is not None and of.first_seq <= self.seen.seq
        telemetry_sent = of.batch is not None and not new_batch
        if of.text and not events_sent and not telemetry_sent:
            self.seen.saw_events(of.update.get("events", []))
            await self.send(text_data=of.text)
            return
        update = dict(of.update, events=[e for e in of.update.get("events", []) if e["seq"] > self.seen.seq])
        if not new_batch:
            update.update(metrics={}, logs=[], timelines=[])
        if not (update["events"] or update.get("metrics") or update.get("logs") or update.get("timelines")):
            return
        self.seen.saw_events(update["events"])
        await self.send_json(update)

    async def _send_telemetry(self, *, through_batch: int) -> int:
        """What the run's telemetry batches after the last one sent through `through_batch` hold, from the database:
        metrics from the last step sent (downsampled as the backlog's), their log lines and the timelines since. Returns
        the run's last event sequence as it was read (the events of those batches are at most that)."""
        frame, lines, through_seq = await self._telemetry(through_batch=through_batch)
        self.seen.saw_batch(through_batch, last_step=None)
        self.seen.saw_metrics(frame["metrics"])
        frame["logs"] = await self._send_all_but_last_log_page(lines)
        await self.send_json(frame)
        return through_seq

    async def _send_all_but_last_log_page(self, lines: list[LoggedLine]) -> list[str]:
        """These lines in pages of at most LOG_FRAME_CHARS of JSON: sends all but the last page, each in a frame of its
        own, and returns the last (for the frame that goes next)."""
        pages = _log_pages(lines)
        for page in pages[:-1]:
            await self.send_json(self._logs_frame(page))
        return [line.text for line in pages[-1]] if pages else []

    def _logs_frame(self, lines: list[LoggedLine]) -> dict:
        """Log lines alone, and where the last of them is: a page that has these and drops before the frame they go
        with resumes from there."""
        return {**self._empty_update(), "logs": [line.text for line in lines], "timelines": [],
                "logs_through": {"batch": lines[-1].batch, "line": lines[-1].index}}

    def _empty_update(self) -> dict:
        return {"type": "run.update", "run": self.run_id, "events": [], "metrics": {}, "logs": []}

    async def _send_events(self, *, through_seq: int, first: dict, rest: dict) -> None:
        """The events after the last one sent up to `through_seq`, a page at a time (live updates wait meanwhile):
        the first page in `first` (sent even when empty), the others in `rest`; each says whether `more` follow."""
        frame = first
        while True:
            events = await self._events_page(through_seq=through_seq)
            more = bool(events) and events[-1]["seq"] < through_seq
            await self.send_json({**frame, "events": events, "more": more})
            self.seen.saw_events(events)
            if not more:
                return
            frame = rest

    @database_sync_to_async
    def _events_page(self, *, through_seq: int) -> list[dict]:
        return events_page(run_id=self.run_id, after_seq=self.seen.seq, through_seq=through_seq,
                           max_events=BACKLOG_PAGE_EVENTS, max_chars=BACKLOG_PAGE_CHARS)

    @database_sync_to_async
    def _may_read(self, actor, run_id: int) -> bool:  # noqa: ANN001
        run = Run.objects.select_related("experiment__project").filter(pk=run_id).first()
        self.project_id = run.experiment.project_id if run else None
        return run is not None and project_role(actor=actor, project=run.experiment.project) is not None

    @database_sync_to_async
    def _backlog(self, start: ResumePoint) -> tuple[dict, list[LoggedLine], int]:
        """The backlog's first frame but its events and log lines, its log lines (after the page's), and the last event
        sequence the backlog goes to: the run's as it was read, which its state in the frame goes with (and its log
        lines, to its last telemetry batch)."""
        run = Run.objects.get(pk=self.run_id)
        metrics = metrics_from_step(run=run, step=start.step, buckets=BACKLOG_POINTS_PER_KEY)
        lines = log_tail(run_id=run.pk, after_batch=start.batch, after_index=start.line, through_batch=run.telemetry_seq,
                         last=MISSED_LOG_LINES if start.resumes else BACKLOG_LOG_LINES)
        frame = {"type": "run.backlog", "run": run.pk, "state": run.state, "exit_reason": run.exit_reason,
                 "metrics": _wire_points(metrics), "logs": [],
                 "timelines": step_timelines(run=run, last=BACKLOG_TIMELINES), "telemetry_seq": run.telemetry_seq}
        return frame, lines, run.last_event_seq

    @database_sync_to_async
    def _telemetry(self, *, through_batch: int) -> tuple[dict, list[LoggedLine], int]:
        run = Run.objects.get(pk=self.run_id)
        metrics = metrics_from_step(run=run, step=self.seen.step, buckets=BACKLOG_POINTS_PER_KEY)
        lines = log_tail(run_id=run.pk, after_batch=self.seen.batch, through_batch=through_batch, last=MISSED_LOG_LINES)
        frame = {"type": "run.update", "run": run.pk, "telemetry_seq": through_batch, "events": [],
                 "metrics": _wire_points(metrics), "logs": [],
                 "timelines": step_timelines(run=run, last=BACKLOG_TIMELINES, from_step=self.seen.step)}
        return frame, lines, run.last_event_seq


def _log_pages(lines: list[LoggedLine]) -> list[list[LoggedLine]]:
    """The lines in order, in pages of at most LOG_FRAME_CHARS of JSON each (a longer line is a page of its own)."""
    pages: list[list[LoggedLine]] = []
    chars = LOG_FRAME_CHARS
    for line in lines:
        size = len(json.dumps(line.text)) + 2  # its quotes and escapes, and the comma and space between lines
        if chars + size > LOG_FRAME_CHARS:
            pages.append([])
            chars = 0
        pages[-1].append(line)
        chars += size
    return pages


def _wire_points(metrics: dict[str, list[Bucket]]) -> dict[str, list[list]]:
    return {key: [[b.step, wire_number(b.mean)] for b in buckets] for key, buckets in metrics.items()}


class ProjectStreamConsumer(LiveConsumer):
    """`/ws/projects/<slug>/`: state changes of the project's runs."""

    live_types = frozenset({"project.update"})

    async def connect(self) -> None:
        query = parse_qs(self.scope["query_string"].decode())
        actor = await _actor_for(self.scope, query)
        if actor is None:
            await self.close(code=CLOSE_UNAUTHORIZED)
            return
        self.project_id = await self._project_id(actor, self.scope["url_route"]["kwargs"]["slug"])
        if self.project_id is None:
            await self.close(code=CLOSE_NOT_FOUND)
            return
        await self.channel_layer.group_add(project_group(self.project_id), self.channel_name)
        await self.accept()
        await self.follow_access(actor=actor, project_id=self.project_id)

    async def disconnect(self, code: int) -> None:
        await self.stop_following_access()
        if getattr(self, "project_id", None) is not None:
            await self.channel_layer.group_discard(project_group(self.project_id), self.channel_name)

    async def project_update(self, message: dict) -> None:
        await self.send_json(message["update"])

    @database_sync_to_async
    def _project_id(self, actor, slug: str) -> int | None:  # noqa: ANN001
        project = Project.objects.filter(slug=slug).first()
        if project is None or project_role(actor=actor, project=project) is None:
            return None
        return project.pk
