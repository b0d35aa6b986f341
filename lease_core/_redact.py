"""The one function that masks passwords in text shown to people: messages, logs, reprs."""

from __future__ import annotations

import re

__all__ = ["redact"]

MASK = "***"

# ``user:password@`` after ``scheme://``, or at the start of a word (``user:pw@host:5432``).
# The password runs to the last ``@`` before the path, so an unescaped ``@`` in it is masked.
_USERINFO = re.compile(
    r"""(?:(?<=://)|(?<![^\s'"(<\[,=]))([^:/@\s'"]*):([^\s/?#]*)@"""
)
# A password written with an unescaped ``/``, ``?`` or ``#`` (which end the userinfo for a
# URL parser, so a driver would refuse the URL): up to the last ``@`` of the word.
_USERINFO_UNESCAPED = re.compile(
    r"""(?<=://)([^:/@\s'"]*):(?!\*\*\*@)([^\s'"]*)@(?=[^\s'"@]*(?:[\s'"]|$))"""
)
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
    every occurrence of the given ``secrets`` (a password known from elsewhere).
    """
    for secret in secrets:
        if secret:
            text = text.replace(secret, MASK)
    text = _USERINFO.sub(lambda m: f"{m.group(1)}:{MASK}@", text)
    text = _USERINFO_UNESCAPED.sub(lambda m: f"{m.group(1)}:{MASK}@", text)
    text = _QUERY_PASSWORD.sub(lambda m: m.group(1) + MASK, text)
    return _PASSWORD_PAIR.sub(lambda m: m.group(1) + MASK, text)
