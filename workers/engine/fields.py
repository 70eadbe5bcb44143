"""Field-level errors shared by every schema the engine validates (run configs, operator commands).

Importing this module imports pydantic only: the web process uses it to validate cheaply.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, ValidationError


class StrictModel(BaseModel):
    """Unknown keys are errors; values are frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_enum_values=True)


@dataclass(frozen=True)
class FieldError:
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}" if self.field else self.message


class ConfigError(Exception):
    """A config that cannot be used; `errors` names each field and why."""

    heading = "invalid config"  # what the command line prints above the errors

    def __init__(self, errors: Sequence[FieldError]):
        self.errors = list(errors)
        super().__init__("; ".join(str(e) for e in self.errors))

    @classmethod
    def on(cls, field: str, message: str) -> ConfigError:
        """One field's error."""
        return cls([FieldError(field, message)])

    def __reduce__(self) -> tuple[type[ConfigError], tuple[list[FieldError]]]:
        """Pickled by its errors (a Monarch actor's refusal reaches the controller so), not by its text."""
        return type(self), (self.errors,)


class FieldProblems(ValueError):
    """Raised by a model validator to report problems against the model's own fields."""

    def __init__(self, problems: Sequence[tuple[str, str]]):
        self.problems = list(problems)
        super().__init__("; ".join(f"{field}: {message}" for field, message in self.problems))


def field_errors(exc: ValidationError, *, prefix: str = "") -> list[FieldError]:
    errors = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in (prefix, *err["loc"]) if p != "")
        cause = err.get("ctx", {}).get("error")
        if isinstance(cause, FieldProblems):
            errors.extend(FieldError(f"{loc}.{field}" if loc else field, message) for field, message in cause.problems)
            continue
        message = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
        if message.startswith("Value error, "):
            message = message.removeprefix("Value error, ")
        errors.append(FieldError(loc, message))
    return errors
