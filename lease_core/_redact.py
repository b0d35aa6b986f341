"""The one function that masks passwords in text shown to people: messages, logs, reprs."""

from __future__ import annotations

import re

__all__ = ["redact"]

MASK = "***"

# A URL's userinfo, ``user:password@``, is found by a scan in code rather than by one regex:
# a regex tried at every word start would read each word to its end again, in time quadratic
# in the length of the text (``',a:' * 16000`` took seconds), and a failed handler's message
# is masked on the event loop. Each piece of text below is read a bounded number of times.
#
# The user: a run of these characters (maybe empty) that ends with ``:``...
_USER_THEN_COLON = re.compile(r"""(?<![^:/@\s'"])[^:/@\s'"]*:""")
# ...starting after ``scheme://`` or at the start of a word (``user:password@host:5432``).
_WORD_START = re.compile(r"""(?:(?<=://)|(?<![^\s'"(<\[,=]))""")
# The password runs to the last ``@`` before the path, so an unescaped ``@`` in it is masked.
_PATH_START = re.compile(r"[\s/?#]")
# After ``scheme://``, a password written with an unescaped ``/``, ``?`` or ``#`` (which end
# the userinfo for a URL parser, so a driver would refuse the URL) runs to the last ``@`` of
# the word.
_WORD_END = re.compile(r"""[\s'"]""")
# ``password=...`` in a URL query (after ``?`` or ``&``, up to ``&`` or ``#``); also
# ``sslpassword=`` and friends.
_QUERY_PASSWORD = re.compile(
    r"""((?<=[?&])[A-Za-z_]*(?:password|passwd)=)([^\s&#'"]+)""", re.IGNORECASE)
# ``password=...`` anywhere else, as in a key/value DSN: quoted (``password='a b'``), or up
# to a space (libpq reads ``password=a&b`` as ``a&b``: a URL's end at ``&`` or ``#`` showed
# the rest).
_PASSWORD_PAIR = re.compile(
    r"""((?<![A-Za-z_?&])(?:[A-Za-z_]*password|passwd)\s*=\s*)"""
    r"""('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"|[^\s'"]+)""",
    re.IGNORECASE,
)


def redact(text: str, *secrets: str | None) -> str:
    """Return ``text`` with every password masked as ``***``.

    Masks the password of a URL's userinfo (``postgresql://user:***@host``), ``password=``
    pairs of a key/value DSN (quoted or not) or of a URL query (``?password=***``), and
    every occurrence of the given ``secrets`` (a password known from elsewhere). Takes time
    linear in the length of ``text``.
    """
    for secret in secrets:
        if secret:
            text = text.replace(secret, MASK)
    if "@" in text:
        text = _mask_userinfo(text, after_scheme_only=False, password_end=_PATH_START)
        text = _mask_userinfo(text, after_scheme_only=True, password_end=_WORD_END)
    text = _QUERY_PASSWORD.sub(lambda m: m.group(1) + MASK, text)
    return _PASSWORD_PAIR.sub(lambda m: m.group(1) + MASK, text)


def _mask_userinfo(text: str, *, after_scheme_only: bool, password_end: re.Pattern[str]) -> str:
    """Mask each ``user:password@``: the password runs to the last ``@`` before ``password_end``.

    The user starts at a word start, or (``after_scheme_only``) only after ``://`` and not
    before a password already masked. The ``:`` before one end share that end and its last
    ``@``: both are looked for once per end, so no piece of text is read again and again.
    """
    pieces: list[str] = []
    done = 0  # text[:done] is in pieces
    end = at = -1  # the password's end for the latest ':', and the last '@' before it
    for user in _USER_THEN_COLON.finditer(text, 0, text.rfind("@")):
        start, colon = user.start(), user.end() - 1
        if start < done:
            continue
        if after_scheme_only:
            after_scheme = start >= 3 and text.startswith("://", start - 3)
            if not after_scheme or text.startswith(MASK + "@", colon + 1):
                continue
        else:
            word = _WORD_START.search(text, start, colon)
            if word is None:
                continue
            start = word.start()
        if colon > end:
            found = password_end.search(text, colon + 1)
            end = found.start() if found else len(text)
            at = text.rfind("@", colon + 1, end)
        if at < colon:
            continue
        pieces += (text[done:start], f"{text[start:colon]}:{MASK}@")
        done = at + 1
    if not pieces:
        return text
    pieces.append(text[done:])
    return "".join(pieces)
