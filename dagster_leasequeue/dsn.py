"""Connection strings: describe and redact them without ever showing a password."""

from __future__ import annotations

import difflib
import re
from urllib.parse import unquote

from psycopg import pq
from psycopg.conninfo import conninfo_to_dict

from .errors import ConfigurationError

# Greedy to the last '@' of the URL: an unencoded '@' in a password stays hidden too.
_URL_PASSWORD = re.compile(r"(?P<scheme>postgres(?:ql)?://[^:/@?#\s]*):(?P<password>\S*)@")
_KEYWORD_PASSWORD = re.compile(r"(?P<key>\bpassword\s*=\s*)(?P<password>'(?:[^'\\]|\\.)*'|\S+)")
_URL_SCHEMES = ("postgresql://", "postgres://")

_EXAMPLE = (
    "expected for example postgresql://user:password@host:5432/dbname "
    "or host=host port=5432 dbname=dbname user=user password='...'"
)

# What libpq's parser says (its first words) and what we say instead. libpq's message quotes
# the part of the DSN it stopped at, which may be a piece of the password, so it is never
# shown; when it says something unforeseen (another version or language), the error only
# names the form of the DSN.
_PROBLEMS = (
    (
        "unexpected spaces found",
        "it holds a space: in a URL write a space as %20 (in the password too), "
        "or use the key=value form with the value in single quotes",
    ),
    (
        'missing "=" after',
        "a key=value pair has no '=': a value with a space must be in single quotes, "
        "as in password='two words'",
    ),
    (
        "unterminated quoted string",
        "a quoted value has no closing quote: end it with ', and write a quote "
        "inside a value as \\'",
    ),
    (
        "invalid percent-encoded token",
        "a '%' is not followed by two hexadecimal digits: in a URL write a '%' as %25",
    ),
    ("forbidden value %00", "it holds %00 (a NUL byte), which no value may hold"),
    (
        "missing key/value separator",
        "a URL query parameter has no '=': write ?name=value&name=value",
    ),
    (
        "extra key/value separator",
        "a URL query parameter has more than one '=': write an '=' in a value as %3D",
    ),
    ("invalid URI query parameter", "a URL query parameter is not a connection option"),
    ("invalid connection option", "a keyword is not a connection option"),
    (
        "IPv6 host address",
        "an IPv6 host is malformed: write it in brackets, as in postgresql://user@[::1]:5432/dbname",
    ),
    (
        "unexpected character",
        "an unexpected character follows the host in the URL: expected :port or /dbname",
    ),
)
# The unknown option libpq names, to suggest the option meant (never to show it).
_UNKNOWN_OPTION = re.compile(r'^(?:invalid URI query parameter: |invalid connection option )"(.*)"')


def redact(text: str, dsn: str | None = None) -> str:
    """Return ``text`` with every password it may hold replaced by ``***``.

    Both URL (``postgresql://user:secret@host``) and keyword (``password=secret``) forms are
    covered; when the DSN is given, its password is also removed wherever else it appears
    (a driver may quote it inside a longer message).
    """
    text = _URL_PASSWORD.sub(r"\g<scheme>:***@", text)
    text = _KEYWORD_PASSWORD.sub(r"\g<key>***", text)
    if dsn:
        for password in sorted(_passwords_of(dsn), key=len, reverse=True):
            text = text.replace(password, "***")
    return text


def _passwords_of(dsn: str) -> set[str]:
    """The DSN's password; for a DSN libpq cannot parse, each text that may be it."""
    try:
        password = conninfo_to_dict(dsn).get("password")
    except Exception:
        pass
    else:
        return {str(password)} if password else set()
    found: set[str] = set()
    if dsn.startswith(_URL_SCHEMES):
        rest = dsn.partition("://")[2]
        # libpq ends the user part at the first '@'; the user may have meant the last.
        for end in {rest.find("@"), rest.rfind("@")} - {-1}:
            _user, colon, password = rest[:end].partition(":")
            if colon and password:
                found |= {password, unquote(password)}
    for match in re.finditer(r"\bpassword\s*=\s*", dsn):
        value = dsn[match.end() :]
        if value.startswith("'"):
            # Up to the closing quote; an unterminated value runs to the end.
            closed = re.match(r"'((?:[^'\\]|\\.)*)'", value)
            found.add(closed.group(1) if closed else value[1:])
        elif value:
            found.add(value.split()[0])
    return {password for password in found if password}


def describe(dsn: str) -> str:
    """A short, password-free description of where a DSN points: ``host:port/dbname``.

    Raises :class:`ConfigurationError` if the DSN cannot be used. The message says what is
    wrong and gives an example, but quotes nothing of the DSN: a malformed DSN cannot be
    split reliably into a password and the rest.
    """
    params = _parse(dsn)
    ports = str(params.get("port") or "")
    if not all(_is_port(port) for port in ports.split(",")):
        # postgresql://user:password/dbname: libpq reads user as the host, password as the port.
        hint = (
            " (in a URL, user:password needs @host after it, or the password is read as the port)"
            if dsn.startswith(_URL_SCHEMES) and "@" not in dsn
            else ""
        )
        raise ConfigurationError(_invalid(f"a port is not a number from 1 to 65535{hint}"))
    # Several hosts (libpq's failover): each with its port, or all with the one port given.
    hosts = str(params.get("host") or params.get("hostaddr") or "localhost").split(",")
    port_list = ports.split(",") if ports else ["5432"]
    if len(port_list) == 1:
        port_list *= len(hosts)
    if len(port_list) != len(hosts):
        raise ConfigurationError(_invalid("it gives a number of ports other than its hosts'"))
    places = [
        f"socket {host or '/tmp'}" if not host or host.startswith("/") else f"{host}:{port or 5432}"
        for host, port in zip(hosts, port_list, strict=True)
    ]
    where = ",".join(places)
    dbname = str(params.get("dbname") or params.get("user") or "")
    return f"{where}/{dbname}" if dbname else where


def _parse(dsn: str) -> dict[str, object]:
    """The DSN's parameters, or a ConfigurationError that holds no part of it."""
    if not isinstance(dsn, str):
        raise ConfigurationError(
            f"the DSN must be a str, not {type(dsn).__name__}; {_EXAMPLE.replace('expected ', '')}"
        )
    _refuse_unencoded_url_password(dsn)
    problem = None
    if "\x00" in dsn:
        problem = "it holds a NUL character"
    else:
        try:
            return dict(conninfo_to_dict(dsn))
        except UnicodeError:
            problem = "it is not valid Unicode text"
        except Exception as exc:
            problem = _problem(str(exc))
    # Raised here, not in the except block: the driver's error (which quotes the DSN) must
    # not travel along as the new error's __context__.
    raise ConfigurationError(_invalid(problem))


def _problem(libpq_message: str) -> str:
    """What we say of a parse error, chosen by libpq's message, which is never shown."""
    message = libpq_message.strip()
    for start, explanation in _PROBLEMS:
        if start in message:
            unknown = _UNKNOWN_OPTION.match(message)
            if unknown:
                keywords = [option.keyword.decode() for option in pq.Conninfo.get_defaults()]
                meant = difflib.get_close_matches(unknown.group(1), keywords, n=1, cutoff=0.75)
                if meant:
                    explanation += f" (did you mean {meant[0]}?)"
            return explanation
    return "it could not be parsed"


def _invalid(problem: str) -> str:
    return f"the DSN is not a valid PostgreSQL connection string: {problem}; {_EXAMPLE}"


def _is_port(text: str) -> bool:
    text = text.strip()
    return not text or (text.isascii() and text.isdigit() and 1 <= int(text) <= 65535)


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
