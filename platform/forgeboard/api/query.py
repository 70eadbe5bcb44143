"""Whole numbers in a query string as the OpenAPI document's JSON Schema reads them: `1e+18` is the integer
10**18, so it is accepted as one (a client that formats numbers generically sends that); `1.5e3` or `1e+18.5`
stay refused."""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Annotated, Any

from pydantic import BeforeValidator

_EXPONENT_FORM = re.compile(r"[+-]?\d{1,20}(\.\d{1,20})?[eE][+-]?\d{1,2}")


def _integral(value: Any) -> Any:
    if isinstance(value, str) and _EXPONENT_FORM.fullmatch(value):
        number = Decimal(value)
        if number == number.to_integral_value():
            return int(number)
    return value


# Bounds go in Query(..., ge=, le=), which the document shows as minimum and maximum.
QueryInt = Annotated[int, BeforeValidator(_integral)]
OptionalQueryInt = Annotated[int | None, BeforeValidator(_integral)]
