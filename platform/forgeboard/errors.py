"""Errors that services raise for problems a user can cause. Views and APIs turn them into 4xx."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from workers.engine.wire_limits import unstorable_reason


@dataclass(frozen=True)
class FieldProblem:
    field: str
    message: str

    def as_dict(self) -> dict[str, str]:
        return {"field": self.field, "message": self.message}


class ServiceError(Exception):
    status = 400
    code = "invalid"

    def __init__(self, message: str, *, problems: Sequence[FieldProblem] = ()):
        super().__init__(message)
        self.message = message
        self.problems = list(problems)

    def as_dict(self) -> dict:
        return {"code": self.code, "message": self.message, "errors": [p.as_dict() for p in self.problems]}


class ValidationFailed(ServiceError):
    status = 400
    code = "validation_failed"

    @classmethod
    def on(cls, field: str, message: str) -> ValidationFailed:
        return cls(f"{field}: {message}" if field else message, problems=[FieldProblem(field, message)])


class AlreadyExists(ValidationFailed):
    """A name already taken: a field error like any other (forms show it at the field), answered 409."""

    status = 409
    code = "conflict"


class PermissionDenied(ServiceError):
    status = 403
    code = "permission_denied"


class NotFound(ServiceError):
    status = 404
    code = "not_found"


class Conflict(ServiceError):
    status = 409
    code = "conflict"


MAX_DB_ID = 2**63 - 1


def is_db_id(value: int) -> bool:
    """Whether an id from a URL can name a row at all (larger ones would overflow the database's bigint)."""
    return isinstance(value, int) and 0 < value <= MAX_DB_ID


def is_db_text(value: str) -> bool:
    """Whether text from a request can name a row at all: no database stores a NUL or a lone surrogate (and
    Postgres refuses a query that compares with one, a 500 where it should find nothing)."""
    return unstorable_reason(value) is None


def clean_text(*, field: str, value: object, max_length: int, required: bool = True) -> str:
    """Stripped text within a length, or ValidationFailed naming the field (names, descriptions)."""
    if not isinstance(value, str):
        raise ValidationFailed.on(field, "must be text")
    reason = unstorable_reason(value)
    if reason:
        raise ValidationFailed.on(field, reason)
    cleaned = value.strip()
    if required and not cleaned:
        raise ValidationFailed.on(field, "must not be empty")
    if len(cleaned) > max_length:
        raise ValidationFailed.on(field, f"must be at most {max_length} characters, got {len(cleaned)}")
    return cleaned
