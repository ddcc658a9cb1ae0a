"""How the ``recloop`` command ends: one JSON object on stdout, or one line saying what went wrong.

Every command runs inside ``ErrorBoundary`` (the command group's class):

- a failure prints ``error: <what happened>`` on stderr, one line, and exits non-zero: 2 for a usage
  error (bad option, bad spec), 3 when a service (MLflow, Redis, PostgreSQL, Prefect) is unreachable,
  1 for anything else. ``recloop --debug <command>`` prints the traceback instead, with the same code;
- a verdict against what was asked is not a failure but has its own code: ``recloop gate`` exits 4 when it
  refuses the candidate (its report printed as for a pass), so ``recloop gate && …`` stops there;
- with ``--json``, stdout holds exactly one JSON object whatever happens: the command's summary, or
  ``{"error": ..., "kind": ...}``. ``emit_json`` writes strict JSON: NaN and infinity become ``null``
  (``json.dumps`` would write ``NaN``, which JSON parsers refuse), numpy values plain numbers.

Example::

    app = typer.Typer(cls=ErrorBoundary)
    emit_json({"auc": float("nan")})               # prints {"auc": null}
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

DEBUG_KEY, JSON_KEY = "recloop.debug", "recloop.json"
USAGE_ERROR, FAILURE, SERVICE_UNAVAILABLE = 2, 1, 3
REFUSED = 4  # a gate's refusal: the command ran, its verdict is no
INTERRUPTED = 130  # Ctrl-C: the shell's code for a process ended by SIGINT


def plain_errors() -> tuple[type[BaseException], ...]:
    """Errors whose message is already written for a user: shown as they are, without the type's name.
    (Imported here, not at the top: ``recloop --help`` must not pay for pandas.)"""
    from recloop.endpoints import ServiceUnavailable
    from recloop.schema import SpecError

    return (ServiceUnavailable, SpecError, FileNotFoundError, PermissionError, ValueError, RuntimeError)

stderr = Console(stderr=True)


def jsonable(value: Any) -> Any:
    """``value`` as strict JSON data: non-finite floats → None, numpy scalars and arrays → Python."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [jsonable(v) for v in value]
    if isinstance(value, bool | int | str) or value is None:
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if hasattr(value, "tolist"):  # numpy scalars and arrays
        return jsonable(value.tolist())
    return str(value)


def emit_json(payload: dict) -> None:
    """Print one strict JSON object on stdout."""
    sys.stdout.write(json.dumps(jsonable(payload), allow_nan=False) + "\n")
    sys.stdout.flush()


def one_line(err: BaseException) -> str:
    """What a user needs from an exception, on one line."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    message = lines[0] if lines else ""
    if isinstance(err, plain_errors()) and message:
        return message
    return f"{type(err).__name__}: {message}" if message else type(err).__name__


class UserError(Exception):
    """Something the user asked for cannot be done (a bad option, a missing file): one line, exit ``code``."""

    def __init__(self, message: str, code: int = USAGE_ERROR):
        super().__init__(message)
        self.code = code


def fail(message: str, code: int = USAGE_ERROR) -> UserError:
    """``raise fail("--days must be ...")``: the boundary prints it (and the JSON error under ``--json``)."""
    return UserError(message, code)


class ErrorBoundary(TyperGroup):
    """The command group: notes ``--json`` before parsing, and turns an escaping exception into one line."""

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        ctx.meta[JSON_KEY] = "--json" in args
        return super().parse_args(ctx, args)

    def invoke(self, ctx: typer.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (typer.Exit, typer.Abort):
            raise
        except typer.TyperException as err:  # usage errors (click's own): it prints them; JSON gets them too
            if ctx.meta.get(JSON_KEY):
                emit_json({"error": err.format_message(), "kind": "usage"})
            raise
        except UserError as err:
            self._report(ctx, str(err), "usage" if err.code == USAGE_ERROR else "failure", hint=False)
            raise typer.Exit(code=err.code) from None
        except KeyboardInterrupt:  # Ctrl-C: one line (and under --json one object), not click's "Aborted!"
            self._report(ctx, "interrupted (Ctrl-C)", "interrupted", hint=False)
            raise typer.Exit(code=INTERRUPTED) from None
        except Exception as err:
            from recloop.endpoints import ServiceUnavailable
            from recloop.settings import SettingsError

            if isinstance(err, SettingsError):  # a RECLOOP_* variable: one line naming it, as a bad option is
                self._report(ctx, str(err), "usage", hint=False)
                raise typer.Exit(code=USAGE_ERROR) from None

            unavailable = isinstance(err, ServiceUnavailable)
            code = SERVICE_UNAVAILABLE if unavailable else FAILURE
            if ctx.meta.get(DEBUG_KEY):  # the traceback, and the same exit code (a script's check must not change)
                import traceback

                traceback.print_exc(file=sys.stderr)
                raise typer.Exit(code=code) from None
            self._report(ctx, one_line(err), "service_unavailable" if unavailable else type(err).__name__, hint=True)
            raise typer.Exit(code=code) from None

    @staticmethod
    def _report(ctx: typer.Context, message: str, kind: str, hint: bool) -> None:
        more = " [dim](recloop --debug … shows the traceback)[/]" if hint else ""
        stderr.print(f"[bold red]error:[/] {escape(message)}{more}", soft_wrap=True)
        if ctx.meta.get(JSON_KEY):
            emit_json({"error": message, "kind": kind})


def debug_option(ctx: typer.Context, debug: bool) -> None:
    """The app callback's body: remember ``--debug`` for the boundary."""
    ctx.meta[DEBUG_KEY] = debug
