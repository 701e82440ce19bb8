"""A user's mistake and the checks that find it: `InputError` and the validators every config section and CLI uses.

A mistake in what the user gave (a config value, a mesh, a path, a corpus) is an `InputError`: one line naming the
field or file and what to do; the command lines (`cli.main_guard`) turn it into that line on stderr and exit code 2,
without a traceback. `InputError` subclasses ValueError, so callers that catch ValueError keep working.

    raise InputError("train.eval_every=-1: must be >= 0 (0 = no periodic eval)")   # anywhere below a CLI
    check_range("train", cfg, "eval_every", ge=0)                                   # the same, from a dataclass
    for where, obj in json_lines(path, "prompts file"): ...                         # a JSONL file, line by line
"""

from __future__ import annotations

import difflib
import json
import numbers
from collections.abc import Iterable, Iterator
from typing import Any


class InputError(ValueError):
    """Something the user gave is wrong; the message names it and says what to do."""



def check_known_fields(section: str, given: Iterable[str], valid: Iterable[str]) -> None:
    """InputError "<section> has no field 'x'; nearest: ...; valid fields: ..." unless every name in `given` is
    in `valid`. `section` is the full path the user reaches the fields by (config.model, config.data.phases.general).
    One message for every config section, whether the config flags or a section's dataclass found the name."""
    valid = sorted(valid)
    unknown = sorted(set(given) - set(valid))
    if not unknown:
        return

    def nearest(name: str) -> str:
        return ", ".join(difflib.get_close_matches(name, valid, n=3)) or "no close match"

    if len(unknown) == 1:
        names, near = repr(unknown[0]), nearest(unknown[0])
    else:
        names, near = ", ".join(map(repr, unknown)), "; ".join(f"{n!r} -> {nearest(n)}" for n in unknown)
    raise InputError(f"{section} has no field{'s' if len(unknown) > 1 else ''} {names}; nearest: {near}; "
                     f"valid fields: {', '.join(valid)}")


# --- checking a config section's values --------------------------------------------------------

def check_field(section: str, field: str, value: Any, ok: bool, why: str, fix: str) -> None:
    """InputError "<section>.<field>=<value>: <why>; <fix>" unless `ok`. `section` is how the user
    reaches the field on the command line (--config.<section>.<field>)."""
    if not ok:
        raise InputError(f"{section}.{field}={value!r}: {why}; {fix}")


def check_range(section: str, obj: Any, field: str, *, gt: float | None = None, ge: float | None = None,
                lt: float | None = None, le: float | None = None, meaning: str = "") -> None:
    """`obj.<field>` is a number within the given bounds (a NaN never is)."""
    value = getattr(obj, field)
    low, high = (gt if gt is not None else ge), (lt if lt is not None else le)
    if low is not None and high is not None:
        bounds = f"in {'(' if gt is not None else '['}{low}, {high}{')' if lt is not None else ']'}"
    elif low is not None:
        bounds = f"{'>' if gt is not None else '>='} {low}"
    else:
        bounds = f"{'<' if lt is not None else '<='} {high}"
    why = f"must be {bounds}" + (f" ({meaning})" if meaning else "")
    fix = f"set --config.{section}.{field} to a value {bounds}"
    # bool is an int to Python; a flag in a numeric field is a mistake all the same.
    check_field(section, field, value, isinstance(value, numbers.Real) and not isinstance(value, bool), why, fix)
    ok = ((gt is None or value > gt) and (ge is None or value >= ge)
          and (lt is None or value < lt) and (le is None or value <= le))
    check_field(section, field, value, ok, why, fix)


def check_at_least(section: str, obj: Any, minimum: float, *fields: str, meaning: str = "") -> None:
    """Each of `obj`'s `fields` is a number >= `minimum`."""
    for field in fields:
        check_range(section, obj, field, ge=minimum, meaning=meaning)


def check_choice(section: str, obj: Any, field: str, allowed: tuple[Any, ...], why: str = "") -> None:
    value = getattr(obj, field)
    check_field(section, field, value, value in allowed, f"must be one of {allowed}" + (f" ({why})" if why else ""),
                f"set --config.{section}.{field} to one of them")


def json_lines(path: str, what: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """("path:line", object) for each non-blank line of a file of JSON objects, one per line. InputError naming
    `what` and the path when the file does not open, and path:line for a line that is not UTF-8, not JSON or not an
    object; what an object must hold is the caller's to check (naming the same path:line)."""
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed by the `with f` below; only the open is the user's mistake
    except OSError as e:
        raise InputError(f"{what} {path}: {e.strerror}") from None
    with f:
        for n, raw in enumerate(f, 1):
            where = f"{path}:{n}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise InputError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{where}: not a JSON line ({e.msg})") from None
            if not isinstance(obj, dict):
                raise InputError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            yield where, obj
