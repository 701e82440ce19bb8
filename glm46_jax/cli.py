"""What every command-line entry point shares: how a user's mistake (`errors.InputError`) is reported, flag
parsing, and size parsing.

    if __name__ == "__main__":
        cli.main_guard(main)          # InputError & co -> "error: <message>" on stderr, exit 2
        cli.run_absl(main)            # the same for an absl app, flag parsing included

An `InputError` (and a missing file, a bad flag or config file) becomes one line and exit code 2, no traceback.
Anything else is an internal error and keeps its traceback.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from typing import Any

from glm46_jax import host
from glm46_jax.errors import InputError, check_known_fields


class ArgumentParser(argparse.ArgumentParser):
    """argparse for the argparse CLIs (score, convert, data_prep): a bad flag is a user's mistake like any
    other, raised as `InputError` (one line, exit 2), instead of argparse's usage block + exit."""

    def error(self, message: str):
        raise InputError(f"{self.prog}: {message} (see --help)")


def user_errors() -> tuple[type[BaseException], ...]:
    """The exception types a CLI reports as one line: ours, a missing file, a bad flag or config file."""
    from absl import flags  # imported late: data_prep's CLI does not otherwise need absl

    return InputError, FileNotFoundError, NotADirectoryError, IsADirectoryError, flags.Error


def main_guard(main: Callable[..., Any], *args: Any) -> None:
    """Run `main(*args)`; a user error becomes `error: ...` on stderr and exit code 2. Applies the CPU host
    settings first (`host.configure_cpu`): entry points call this before jax touches a device."""
    host.configure_cpu()
    try:
        result = main(*args)
    except user_errors() as err:
        print(f"error: {_one_line(err)}", file=sys.stderr)
        sys.exit(2)
    if isinstance(result, int) and not isinstance(result, bool):
        sys.exit(result)


def run_absl(main: Callable[[list[str]], Any]) -> None:
    """`absl.app.run(main)` for the absl-flag CLIs (train, bench): a bad flag, a config file that does not
    load or a bad `--config.x.y=` override is one line and exit 2 as well, instead of absl's usage dump."""
    from absl import app, flags

    host.configure_cpu()  # before flag parsing: a config file may import modules that start jax

    def parse(argv: list[str]) -> list[str]:
        try:
            return parse_flags(flags.FLAGS, argv)
        except InputError as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(2)

    app.run(lambda argv: main_guard(main, argv), flags_parser=parse)


def parse_flags(flag_values: Any, argv: list[str]) -> list[str]:
    """`flag_values(argv)` (an absl FlagValues), with a bad flag, a config file that does not load or a bad
    `--config.x.y=` override raised as a one-line `InputError`."""
    from absl import flags

    try:
        return flag_values(argv)
    # ml_collections' config flags report an unknown `--config.x.y` with AttributeError/KeyError and a config
    # file that does not load with whatever it raised: all of it is the command line the user typed.
    except (flags.Error, AttributeError, KeyError, TypeError, ValueError) as err:
        _check_config_overrides(flag_values, argv)
        raise InputError(_one_line(err)) from err


def _check_config_overrides(flag_values: Any, argv: list[str]) -> None:
    """InputError naming the section, the nearest and the valid fields for an override of a field the config file
    does not have. ml_collections' own KeyError names the last key alone ('no_such_field'), and a near miss only
    when one is close; so after a failed parse the config file is loaded again and each override's path walked."""
    from ml_collections import config_dict
    from ml_collections.config_flags.config_flags import ConfigFileFlagParser

    for name in set(flag_values):
        if not isinstance(flag_values[name].parser, ConfigFileFlagParser):
            continue
        given = [m.group(1) if m.group(1) is not None else (argv[i + 1] if i + 1 < len(argv) else None)
                 for i, arg in enumerate(argv) if (m := re.fullmatch(rf"--?{re.escape(name)}(?:=(.*))?", arg))]
        if not given or given[-1] is None:
            continue
        try:
            config = flag_values[name].parser.parse(given[-1])
        except Exception:  # noqa: BLE001, S112 - the file does not load: the original error says why
            continue
        for arg in argv:
            if not (m := re.match(rf"--?(?:no)?{re.escape(name)}\.([^=]+)", arg)):
                continue
            node, where = config, name
            for key in m.group(1).split("."):
                if not isinstance(node, config_dict.ConfigDict) or "[" in key:  # a value, or an index: not a field
                    break
                check_known_fields(where, [key], node.keys())
                node, where = node[key], f"{where}.{key}"


def _one_line(err: BaseException) -> str:
    text = str(err.args[0]) if isinstance(err, (AttributeError, KeyError)) and err.args else str(err)
    if isinstance(err, FileNotFoundError) and err.filename and err.filename not in text:
        text = f"{text}: {err.filename}"
    # ml_collections quotes its AttributeError text twice over, escapes included
    text = text.replace("\\n", "\n").replace("\\'", "'")
    if len(text) > 1 and text[0] == text[-1] and text[0] in "'\"":
        text = text[1:-1]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if "Traceback (most recent call last):" in lines:  # a config file that raised: what it raised, not where
        lines = lines[:lines.index("Traceback (most recent call last):")] + lines[-1:]
    return " ".join(lines) or type(err).__name__


# GB = 10^9 (as disks and the Hugging Face Hub count), GiB = 2^30.
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*")


def parse_bytes(text: str | float, what: str = "size") -> int:
    """'80GiB', '80 GB', '80e9', '85899345920', 5e9 -> bytes. `what` names the flag in the error."""
    m = _SIZE.fullmatch(str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise InputError(f"{what}={text!r}: expected a number of bytes (e.g. 80e9) with an optional unit "
                         "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 80GiB")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value <= 0:
        raise InputError(f"{what}={text!r}: must be > 0")
    return int(value)
