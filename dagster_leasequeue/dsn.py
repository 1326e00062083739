"""Connection strings: describe and redact them without ever showing a password."""

from __future__ import annotations

import re

from psycopg.conninfo import conninfo_to_dict

from .errors import ConfigurationError

# Greedy to the last '@' of the URL: an unencoded '@' in a password stays hidden too.
_URL_PASSWORD = re.compile(r"(?P<scheme>postgres(?:ql)?://[^:/@?#\s]*):(?P<password>\S*)@")
_KEYWORD_PASSWORD = re.compile(r"(?P<key>\bpassword\s*=\s*)(?P<password>'(?:[^'\\]|\\.)*'|\S+)")


def redact(text: str, dsn: str | None = None) -> str:
    """Return ``text`` with every password it may hold replaced by ``***``.

    Both URL (``postgresql://user:secret@host``) and keyword (``password=secret``) forms are
    covered; when the DSN is given, its password is also removed wherever else it appears
    (a driver may quote it inside a longer message).
    """
    text = _URL_PASSWORD.sub(r"\g<scheme>:***@", text)
    text = _KEYWORD_PASSWORD.sub(r"\g<key>***", text)
    if dsn:
        password = _password_of(dsn)
        if password:
            text = text.replace(password, "***")
    return text


def _password_of(dsn: str) -> str | None:
    try:
        password = conninfo_to_dict(dsn).get("password")
    except Exception:
        match = _URL_PASSWORD.search(dsn) or _KEYWORD_PASSWORD.search(dsn)
        password = match.group("password").strip("'") if match else None
    return str(password) if password else None


def describe(dsn: str) -> str:
    """A short, password-free description of where a DSN points: ``host:port/dbname``."""
    _refuse_unencoded_url_password(dsn)
    try:
        params = conninfo_to_dict(dsn)
    except Exception as exc:
        raise ConfigurationError(
            "the DSN is not a valid PostgreSQL connection string "
            f"({redact(str(exc).strip(), dsn)}); expected for example postgresql://user:password@host:5432/dbname"
        ) from None
    host = str(params.get("host") or "localhost")
    port = str(params.get("port") or "5432")
    dbname = str(params.get("dbname") or params.get("user") or "")
    where = f"socket {host}" if host.startswith("/") else f"{host}:{port}"
    return f"{where}/{dbname}" if dbname else where


def _refuse_unencoded_url_password(dsn: str) -> None:
    """Refuse a URL whose user part holds a raw '@' or '/'.

    libpq would split such a URL at the wrong place and take the rest of the password for
    the host or database name, which then shows up in every error message.
    """
    scheme, separator, rest = dsn.partition("://")
    if not separator or scheme not in ("postgres", "postgresql") or "@" not in rest:
        return
    userinfo = rest[: rest.rindex("@")]
    if "@" in userinfo or "/" in userinfo:
        raise ConfigurationError(
            "the DSN's user or password holds '@' or '/': percent-encode them in a URL "
            "(@ as %40, / as %2F), or use the key=value form (password='...')"
        )
