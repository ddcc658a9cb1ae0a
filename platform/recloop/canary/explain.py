"""Why a canary decision was taken, as one table row: the evidence that decided it and the guardrails it held.

A reviewer reads promotions and rollbacks in the demo report and in the canary's MLflow run; a reason in a
sentence is not enough when the raw online CTRs read the other way (an interleaved canary's per-version CTR
counts different users and lists that mix both rankings; the interleaved credit compares both rankings on the
same requests and is what decides). Each row names the action, the paired CTR evidence with its always-valid
interval, the raw CTRs beside it, the guardrails' figures and the controller's reasons. Pure: figures in,
text out.
"""

from __future__ import annotations

import math
import re

COLUMNS = ("step", "action", "share", "online CTR evidence (what decides)", "raw CTR champion / challenger",
           "guardrails (champion / challenger)", "why")


def _number(value) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(float(value)) else None


def evidence_cell(figures: dict) -> str:
    """``interleaving: +12.0% [-3.1%, +30.2%], 240 users``, or ``-`` when no paired evidence was judged."""
    effect, low, high = (_number(figures.get(k)) for k in ("ctr_effect", "ctr_effect_low", "ctr_effect_high"))
    if effect is None:
        return "-"
    interval = f" [{low:+.1%}, {high:+.1%}]" if low is not None and high is not None else ""
    users = _number(figures.get("evidence_users"))
    method = figures.get("evidence_method") or "paired"
    return f"{method}: {effect:+.1%}{interval}" + (f", {users:.0f} users" if users is not None else "")


def raw_ctr_cell(figures: dict) -> str:
    champion, challenger = _number(figures.get("champion_ctr")), _number(figures.get("challenger_ctr"))
    return f"{_fmt(champion, '.3f')} / {_fmt(challenger, '.3f')}"


def guardrails_cell(figures: dict) -> str:
    """Error rate, p99 latency and online AUC of both variants, and the requests they rest on."""
    parts = [f"errors {_fmt(_number(figures.get('champion_error_rate')), '.1%')} / "
             f"{_fmt(_number(figures.get('challenger_error_rate')), '.1%')}",
             f"p99 {_fmt(_number(figures.get('champion_p99_ms')), '.0f')} / "
             f"{_fmt(_number(figures.get('challenger_p99_ms')), '.0f')} ms"]
    if _number(figures.get("champion_auc")) is not None or _number(figures.get("challenger_auc")) is not None:
        parts.append(f"AUC {_fmt(_number(figures.get('champion_auc')), '.3f')} / "
                     f"{_fmt(_number(figures.get('challenger_auc')), '.3f')}")
    requests = _number(figures.get("challenger_requests"))
    if requests is not None:
        parts.append(f"{requests:.0f} challenger requests")
    return "; ".join(parts)


def decision_row(step: int | str, action: str, share: float, figures: dict, reasons) -> dict[str, str]:
    """One decision as the table's cells (``COLUMNS``); a move the raw CTRs contradict says why in its ``why``."""
    why = "; ".join(reasons) or "-"
    champion, challenger = _number(figures.get("champion_ctr")), _number(figures.get("challenger_ctr"))
    if evidence_cell(figures) != "-" and raw_ctr_disagrees(action, champion, challenger):
        why += (f". Its raw CTR is {'lower' if action == 'promote' else 'higher'} than the champion's: "
                + RAW_CTR_NOTE)
    return dict(zip(COLUMNS, (str(step), action, f"{share:.0%}", evidence_cell(figures), raw_ctr_cell(figures),
                              guardrails_cell(figures), why), strict=True))


def markdown_header() -> str:
    return "| " + " | ".join(COLUMNS) + " |\n|" + " --- |" * len(COLUMNS) + "\n"


def markdown_row(row: dict[str, str]) -> str:
    return "| " + " | ".join(row[c].replace("|", "\\|").replace("\n", " ") for c in COLUMNS) + " |\n"


NOTE_CHARACTERS = 7900  # MLflow keeps 8000 characters of a tag (a run's description is one) and cuts the rest
_NOT_SHOWN = re.compile(r"^\*The first (\d+) decisions are not shown here")


def fit_note(note: str, limit: int = NOTE_CHARACTERS) -> str:
    """A description holding a decisions table (``markdown_header`` and rows after it) cut to ``limit`` by
    dropping its oldest rows, never cutting one, with a line before the table counting every row dropped so
    far (MLflow cut a long canary's description in the middle of a row, and each later row was appended to it).

    Example::

        note = fit_note(note + markdown_row(row))
    """
    if len(note) <= limit:
        return note
    lines = note.split("\n")
    rule = next(i for i, line in enumerate(lines) if line.startswith("| ---"))
    preamble, header, rows = lines[:rule - 1], lines[rule - 1:rule + 1], [line for line in lines[rule + 1:] if line]
    dropped = 0
    for i, line in enumerate(preamble):
        if (found := _NOT_SHOWN.match(line)) is not None:
            dropped = int(found.group(1))
            preamble = preamble[:i] + preamble[i + 2:]  # the line and its blank one: written again below
            break

    def text(rows: list[str], dropped: int) -> str:
        notice = (f"*The first {dropped} decisions are not shown here (MLflow keeps {limit + 100} characters of a "
                  "description): each decision is the run's artifact `canary/decision-NNN.json`.*")
        return "\n".join([*preamble, notice, "", *header, *rows]) + "\n"

    while len(rows) > 1 and len(text(rows, dropped)) > limit:
        rows, dropped = rows[1:], dropped + 1
    return text(rows, dropped)


def raw_ctr_disagrees(action: str, champion_ctr: float | None, challenger_ctr: float | None) -> bool:
    """A promotion whose challenger had the lower raw CTR (or a rollback whose challenger had the higher):
    the paired evidence, not the raw figures, decided it, and the report says so."""
    if champion_ctr is None or challenger_ctr is None:
        return False
    return (action == "promote" and challenger_ctr < champion_ctr) or \
        (action == "rollback" and challenger_ctr > champion_ctr)


RAW_CTR_NOTE = ("the raw online CTR per version counts different users' requests (under interleaving, lists that "
                "mix both rankings); the interleaved credit compares both rankings on the same requests, each "
                "click credited to the ranking that placed the item, and its always-valid interval is what decides")


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)
