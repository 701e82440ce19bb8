"""Text normalisation: line endings, Unicode NFC, control characters, whitespace.

Applied to every document before filtering and deduplication, so the quality rules, the hashes and
the tokenizer all see one canonical spelling of the same text. Documents that end up empty are
dropped and counted (`empty`), per domain.
"""

from __future__ import annotations

import re
import unicodedata

# Unicode category Cc is exactly U+0000-U+001F and U+007F-U+009F; keep \t and \n (\r is gone by then).
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_TRAILING_SPACE = re.compile(r"[^\S\n]+$", re.MULTILINE)  # any whitespace but the newline, at a line end
_BLANK_RUN = re.compile(r"\n{4,}")  # 4 newlines = 3 blank lines


def clean_text(text: str) -> str:
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    # Controls go before NFC so that removing one can never leave an un-composed pair behind.
    text = _CONTROL.sub("", text)
    text = unicodedata.normalize("NFC", text)
    text = _TRAILING_SPACE.sub("", text)
    text = _BLANK_RUN.sub("\n\n\n", text)  # at most two blank lines in a row
    return text.strip("\n")  # leading indentation of the first line is kept (code)
