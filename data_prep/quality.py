"""Heuristic quality rules (after Gopher, Rae et al. 2021, App. A), configurable per domain.

Each rule is a field of `QualityRules`; `None` switches it off. A document is removed by the *first*
rule it fails, in field order, and counted under that rule's name, so the per-rule counts add up to
the number of removed documents. Two presets: "prose" (all rules) and "code" (no stop-word or
word-length rule, looser symbol/repetition limits: source code is symbol-heavy and repetitive by
nature). A domain named `code*` gets the code preset unless configured otherwise.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections import Counter
from typing import Any

from glm46_jax.errors import InputError

# Gopher's stop-word rule: English prose contains these words; boilerplate, tables and junk rarely do.
STOP_WORDS = frozenset({"the", "be", "to", "of", "and", "that", "have", "with"})
_WORD = re.compile(r"\w+")
_NOT_ALNUM = re.compile(r"[\W_]")
_SPACE = re.compile(r"\s")
_ASCII_ALNUM = bytes(c for c in range(128) if chr(c).isalnum())
_ASCII_SPACE = bytes(c for c in range(128) if chr(c).isspace())


@dataclasses.dataclass(frozen=True)
class QualityRules:
    min_chars: int | None = 50
    max_chars: int | None = 200_000
    mean_word_length: tuple[float, float] | None = (3.0, 10.0)  # inclusive range over \w+ words
    symbol_ratio_max: float | None = 0.5  # (non-space, non-alphanumeric chars) / alphanumeric chars
    duplicate_line_fraction_max: float | None = 0.3  # non-blank lines equal to an earlier line / non-blank lines
    top_ngram_fraction_max: float | None = 0.2  # chars in the most repeated word n-gram / chars in all words
    top_ngram_n: int = 2
    stop_words_min: int | None = 2  # occurrences of STOP_WORDS (lower-cased)

    @property
    def rule_names(self) -> list[str]:
        names = [f.name for f in dataclasses.fields(self) if f.name != "top_ngram_n"]
        return [name for name in names if getattr(self, name) is not None]


PRESETS: dict[str, QualityRules] = {
    "prose": QualityRules(),
    "code": QualityRules(min_chars=50, max_chars=1_000_000, mean_word_length=None, symbol_ratio_max=1.0,
                         duplicate_line_fraction_max=0.5, top_ngram_fraction_max=0.3, stop_words_min=None),
}


def default_preset(domain: str) -> str:
    return "code" if domain.startswith("code") else "prose"


_COUNTS = ("min_chars", "max_chars", "stop_words_min")
_RATIOS = ("symbol_ratio_max", "duplicate_line_fraction_max", "top_ngram_fraction_max")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_value(domain: str, rule: str, value: Any) -> Any:
    """The override as the rule stores it; a wrong type fails here, in one line, instead of as a
    TypeError deep inside a filter worker."""
    where = f"{domain}.{rule}={json.dumps(value)}"
    if value is None and rule != "top_ngram_n":
        return None
    if rule in _COUNTS or rule == "top_ngram_n":
        least = 1 if rule == "top_ngram_n" else 0
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise InputError(f"{where}: expected an integer >= {least}" + (" or null" if least == 0 else ""))
    elif rule in _RATIOS:
        if not _is_number(value) or value < 0:
            raise InputError(f"{where}: expected a number >= 0 or null")
    elif rule == "mean_word_length":
        if (not isinstance(value, (list, tuple)) or len(value) != 2 or not all(map(_is_number, value))
                or value[0] > value[1]):
            raise InputError(f"{where}: expected a range [low, high] of two numbers, or null")
        return tuple(value)
    return value


def rules_for(domain: str, overrides: dict[str, dict[str, Any]]) -> QualityRules:
    """The preset for `domain` (named by `overrides[domain]["preset"]` or guessed) plus its overrides."""
    fields = overrides.get(domain, {})
    if not isinstance(fields, dict):
        raise InputError(f"quality rules for domain {domain!r}: expected an object of RULE: VALUE, "
                         f"got {json.dumps(fields)}")
    fields = dict(fields)
    preset = fields.pop("preset", default_preset(domain))
    if not isinstance(preset, str) or preset not in PRESETS:
        raise InputError(f"domain {domain!r}: unknown quality preset {json.dumps(preset)}; "
                         f"choose from {sorted(PRESETS)}")
    known = {f.name for f in dataclasses.fields(QualityRules)}
    if unknown := set(fields) - known:
        raise InputError(f"domain {domain!r}: unknown quality rule(s) {sorted(unknown)}; known: {sorted(known)}")
    fields = {rule: _check_value(domain, rule, value) for rule, value in fields.items()}
    return dataclasses.replace(PRESETS[preset], **fields)


def parse_rule_override(arg: str) -> tuple[str, str, Any]:
    """`DOMAIN.RULE=JSON` (e.g. `prose.min_chars=100`, `code.stop_words_min=null`) -> (domain, rule, value)."""
    key, sep, value = arg.partition("=")
    domain, dot, rule = key.rpartition(".")
    if not sep or not dot:
        raise InputError(f"--rule {arg!r}: expected DOMAIN.RULE=VALUE, e.g. prose.min_chars=100")
    try:
        return domain, rule, json.loads(value)
    except json.JSONDecodeError:
        return domain, rule, value  # a bare word, e.g. preset=code


# --- the rules -------------------------------------------------------------------------------------

def _top_ngram_fraction(words: list[str], n: int) -> float:
    if len(words) < n:
        return 0.0
    grams = Counter(zip(*(words[i:] for i in range(n)), strict=False))  # ragged tails end the n-grams
    gram, count = grams.most_common(1)[0]
    if count < 2:  # a phrase that occurs once is not repetition, however short the text
        return 0.0
    return count * sum(map(len, gram)) / max(sum(map(len, words)), 1)


def _symbol_ratio(text: str) -> float:
    """(non-space, non-alphanumeric chars) / alphanumeric chars."""
    if text.isascii():  # bytes.translate deletes in C, ~20x faster than a Unicode-class regex
        raw = text.encode("ascii")
        n_alnum = len(raw) - len(raw.translate(None, _ASCII_ALNUM))
        n_symbol = len(raw.translate(None, _ASCII_ALNUM + _ASCII_SPACE))
    else:
        n_alnum = len(_NOT_ALNUM.sub("", text))
        n_symbol = len(_SPACE.sub("", text)) - n_alnum
    return n_symbol / max(n_alnum, 1)


def _duplicate_line_fraction(text: str) -> float:
    lines = [line.strip() for line in text.split("\n") if line.strip()]
    return (len(lines) - len(set(lines))) / len(lines) if lines else 0.0


# The order rules are tested in (cheap ones first); a document is removed by, and counted under, the first it fails.
RULE_ORDER = ("min_chars", "max_chars", "mean_word_length", "symbol_ratio_max", "duplicate_line_fraction_max",
              "top_ngram_fraction_max", "stop_words_min")


def _words(text: str, cache: dict) -> list[str]:
    if "lower" not in cache:
        cache["lower"] = _WORD.findall(text.lower())
    return cache["lower"]


def fails(rule: str, text: str, rules: QualityRules, cache: dict) -> bool:
    """Whether `text` fails `rule` (which must be on); `cache` holds the text's words between rules."""
    if rule == "min_chars":
        return len(text) < rules.min_chars
    if rule == "max_chars":
        return len(text) > rules.max_chars
    if rule == "mean_word_length":
        words = _words(text, cache)
        lo, hi = rules.mean_word_length
        mean = sum(map(len, words)) / len(words) if words else 0.0
        return not lo <= mean <= hi
    if rule == "symbol_ratio_max":
        return _symbol_ratio(text) > rules.symbol_ratio_max
    if rule == "duplicate_line_fraction_max":
        return _duplicate_line_fraction(text) > rules.duplicate_line_fraction_max
    if rule == "top_ngram_fraction_max":
        return _top_ngram_fraction(_words(text, cache), rules.top_ngram_n) > rules.top_ngram_fraction_max
    if rule == "stop_words_min":
        return sum(w in STOP_WORDS for w in _words(text, cache)) < rules.stop_words_min
    raise KeyError(rule)


def first_failure(text: str, rules: QualityRules) -> str | None:
    """The name of the first rule `text` fails, or None if it passes them all."""
    cache: dict = {}
    return next((r for r in RULE_ORDER if getattr(rules, r) is not None and fails(r, text, rules, cache)), None)
