"""What the serving API accepts and answers: request and response models, each field bounded (ids within
int64, at most ``MAX_CANDIDATES`` candidates, finite numbers exact as float64, text of at most ``MAX_TEXT``
characters), so a bad request is a 422 naming the field before any model runs. ``/rank``, ``/feedback``,
``/admin/*`` (``recloop.serve.app``) and ``/recommend`` (``recloop.serve.recommend``) share them."""

from __future__ import annotations

import math
from collections import Counter
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

MAX_CANDIDATES = 1000
INT64_MAX = 2**63 - 1
EXACT_INT = 2**53  # integers beyond this lose precision as float64, which is what the model computes in
MAX_TEXT = 1024
# strict: JSON's true and "2" are not the ids 1 and 2 (lax validation ranked {"item_ids": [true, "2"]})
Id = Annotated[int, Field(strict=True, ge=0, le=INT64_MAX)]
Count = Annotated[int, Field(strict=True)]


def _distinct(ids: list[int]) -> list[int]:
    """Ids each given once: a candidate listed twice was answered twice with two scores, and a repeated
    impression counted once, so the answer and the journal disagreed about what was shown."""
    if len(set(ids)) != len(ids):
        repeated = sorted(i for i, times in Counter(ids).items() if times > 1)
        raise ValueError(f"ids given more than once: {repeated[:10]}")
    return ids


DistinctIds = Annotated[list[Id], AfterValidator(_distinct)]


def _text(value: str) -> str:
    """Text of at most ``MAX_TEXT`` characters that is valid Unicode (JSON's ``"\\ud800"`` escape decodes to a
    lone surrogate, which no column can store)."""
    if len(value) > MAX_TEXT:
        raise ValueError(f"text of {len(value)} characters: at most {MAX_TEXT}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"text with a lone surrogate at character {err.start}: not valid Unicode") from None
    return value


def _context_value(value: Any, depth: int = 0) -> Any:
    """A context value as the model can take it, or a ValueError saying what is wrong with it.

    Numbers must be finite (Python's JSON parser reads ``Infinity``, ``NaN`` and ``1e999``) and integers
    exact as float64, which is what the model computes in; text is at most ``MAX_TEXT`` characters; a
    list gives one value per candidate, or is a multi-hot value (a list of lists per candidate). The
    spec's own bounds are checked per column when the features are built.
    """
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        if abs(value) > EXACT_INT:
            raise ValueError(f"integer {value} is beyond ±2^53: not exact as a model input")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"must be a finite number, not {value}")
        return value
    if isinstance(value, str):
        return _text(value)
    if isinstance(value, list) and depth < 2:
        if len(value) > MAX_CANDIDATES:
            raise ValueError(f"a list of {len(value)} values: at most {MAX_CANDIDATES}")
        return [_context_value(v, depth + 1) for v in value]
    raise ValueError(f"a context value is a number, text, true/false, null or a list of them, not {type(value).__name__}")


ContextValue = Annotated[Any, AfterValidator(_context_value)]
ContextKey = Annotated[str, Field(max_length=128)]  # pydantic's str already refuses a lone surrogate


class RankRequest(BaseModel):
    """A ranking request. ``context`` holds the spec's categorical, numeric and list columns, each one
    value for all candidates or a list with one value per candidate; a column the spec allows no null in
    is required (the served rows land as events); ``ts`` (default: now) is the event time the features are
    computed at. Each candidate is listed once."""

    model_config = ConfigDict(extra="forbid", strict=False)
    user_id: Id
    item_ids: DistinctIds = Field(min_length=1, max_length=MAX_CANDIDATES)
    context: dict[ContextKey, ContextValue] = Field(default_factory=dict, max_length=64)
    ts: datetime | None = None
    top_k: Count | None = Field(default=None, ge=1, le=MAX_CANDIDATES)


class RankedItem(BaseModel):
    item_id: int
    score: float


class RankResponse(BaseModel):
    request_id: str
    model_version: str
    variant: Literal["champion", "challenger", "interleave"]
    items: list[RankedItem]


class FeedbackRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    request_id: str = Field(pattern=r"^[0-9a-f]{32}$")
    impressions: DistinctIds = Field(min_length=1, max_length=MAX_CANDIDATES)
    clicks: DistinctIds = Field(default_factory=list, max_length=MAX_CANDIDATES)


ModelName = Literal["recloop-ranker", "recloop-retriever"]


class CanaryRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    share: float = Field(ge=0.0, le=1.0, allow_inf_nan=False)
    mode: Literal["interleave", "canary", "shadow"] | None = None
    model: ModelName = "recloop-ranker"


class ReasonRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: str = Field(default="by an operator", max_length=500)
    model: ModelName = "recloop-ranker"
