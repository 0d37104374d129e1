"""Every URL an operator gives: checked where it enters, and never echoed with its credentials.

Why one module: an instance URL arrives by flag, variable, config file, ``POST /instances``,
a DNS or Kubernetes answer and a MoRIIO frame. When each door checked it differently, a port
of ``abc`` or ``99999`` passed one of them and was only found by the prober's HTTP client,
whose ``ValueError`` killed the prober in every worker (issue 31). ``Instance`` calls
``check_base_url``, so every door refuses the same values with the same words.

Why userinfo is refused, not stripped: ``http://user:pw@host`` would send the credentials as
Basic auth to vLLM (which reads a Bearer key: ``EPD_UPSTREAM_API_KEY``), and the URL is an
instance's identity, shown in ``/instances``, logs and client errors. ``redact_url`` is the one
function that hides the userinfo of any URL (state store, OTLP endpoint, kubeconfig server)
before it is shown.
"""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import urlsplit

#: The longest URL accepted: far beyond any real base URL, short enough to echo in one line.
MAX_URL_LENGTH = 2048
#: How much of a refused value an error message quotes (the rest is elided).
MAX_ECHO = 120
#: One DNS label: letters, digits, hyphens (and underscores, which some service names carry),
#: never starting or ending with a hyphen.
_LABEL = re.compile(r"^(?!-)[A-Za-z0-9_-]{1,63}(?<!-)$")
#: ``scheme://userinfo@`` in any URL-like string, found without parsing it (a string that fails
#: to parse must be redacted too). A scheme is at most 32 characters: an unbounded one made
#: the search quadratic (a minute for a 100 kB value).
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]{0,31}://)(?P<info>[^/?#\s]*)@")
#: ``userinfo@host`` written without a scheme (``user:pw@host:port``), at a word's start.
_BARE_USERINFO = re.compile(r"(?:^|(?<=[\s'\"(]))(?![A-Za-z][A-Za-z0-9+.-]{0,31}://)[^\s/@'\"]+@")


def redact_url(value: str) -> str:
    """``value`` with the userinfo of every URL in it replaced by ``***``.

    Works on any string (an error message, a list of URLs, a value that is not a URL), so a
    caller never has to know whether a URL carries credentials before it logs it."""
    return _BARE_USERINFO.sub("***@", _USERINFO.sub(lambda m: f"{m['scheme']}***@", value))


def echo(value: object) -> str:
    """A refused value as an error message quotes it: redacted, ``repr``-escaped (one line,
    whatever control characters it holds) and cut to ``MAX_ECHO`` characters."""
    text = redact_url(value) if isinstance(value, str) else value
    shown = repr(text)
    return shown if len(shown) <= MAX_ECHO else shown[:MAX_ECHO] + "...'"


def check_port(text: str, where: str) -> int:
    """A port as written in a URL: digits only, 1..65535; ``ValueError`` quotes ``where``."""
    if not text.isascii() or not text.isdigit() or not 1 <= int(text) <= 65535:
        raise ValueError(f"bad port {echo(text)} in {echo(where)}: expected an integer "
                         f"from 1 to 65535")
    return int(text)


def check_host(host: str, where: str) -> str:
    """A host name or IP address (IPv6 in brackets); ``ValueError`` says what is wrong.

    A non-ASCII name is refused with its IDNA (``xn--``) spelling: resolvers and TLS compare
    that form, and two spellings of one host would be two instances."""
    if not host:
        raise ValueError(f"no host in {echo(where)}")
    if host.startswith("["):
        if not host.endswith("]"):
            raise ValueError(f"bad IPv6 address in {echo(where)}")
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise ValueError(f"bad IPv6 address {echo(host)} in {echo(where)}") from None
        return host
    if not host.isascii():
        try:
            spelled = host.encode("idna").decode("ascii")
        except UnicodeError:
            raise ValueError(f"host {echo(host)} in {echo(where)} is not a valid "
                             f"internationalised name") from None
        raise ValueError(f"host {echo(host)} in {echo(where)} is not ASCII: write it as "
                         f"{spelled!r}")
    name = host[:-1] if host.endswith(".") else host
    if len(name) > 253 or not all(_LABEL.match(label) for label in name.split(".")):
        raise ValueError(f"bad host {echo(host)} in {echo(where)}: expected a DNS name "
                         f"(letters, digits, '-', '.') or an IP address")
    return host


def check_base_url(url: str, *, what: str = "instance URL", userinfo: bool = False) -> str:
    """An instance's base URL, checked and spelled one way (no trailing ``/``).

    Accepted: ``http`` or ``https``, a host, an optional port 1..65535 and an optional path.
    Refused, each by name: whitespace or control characters, userinfo, a query, a fragment, a
    bad host or port, more than ``MAX_URL_LENGTH`` characters. ``what`` names the URL in the
    message; ``userinfo`` lets a URL that is no instance's (an OTLP endpoint) carry it."""
    if not isinstance(url, str):
        # ValueError, not TypeError: every door turns exactly this into its 400 or exit 2.
        raise ValueError(f"{what} must be a string, got {echo(url)}")  # noqa: TRY004
    if len(url) > MAX_URL_LENGTH:
        raise ValueError(f"{what} longer than {MAX_URL_LENGTH} characters: {echo(url)}")
    if any(ch.isspace() or not ch.isprintable() for ch in url):
        raise ValueError(f"{what} contains whitespace or a control character: "
                         f"{echo(url)} (list several URLs as separate values)")
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("http", "https"):
        raise ValueError(f"{what} must start with http:// or https://: {echo(url)}")
    netloc = rest.split("/", 1)[0].split("?", 1)[0].split("#", 1)[0]
    if "@" in netloc and not userinfo:
        raise ValueError(f"{what} must not carry a user or password ({echo(url)}): "
                         f"give vLLM's key as EPD_UPSTREAM_API_KEY")
    if "?" in url or "#" in url:
        raise ValueError(f"{what} must be a plain base URL (host, port, optional path; "
                         f"no query or '#', except a '#dp=N' suffix): {echo(url)}")
    host, port = _host_and_port(netloc.rpartition("@")[2])
    check_host(host, url)
    if port is not None:
        check_port(port, url)
    try:  # the HTTP client's own reading must agree with ours
        parts = urlsplit(url)
        agrees = parts.hostname is not None and parts.port == (None if port is None
                                                                else int(port))
    except ValueError:
        agrees = False
    if not agrees:
        raise ValueError(f"bad host or port in {echo(url)}")
    return url.rstrip("/")


def _host_and_port(netloc: str) -> tuple[str, str | None]:
    """``host:port`` split, brackets kept on an IPv6 host; None when no port is written."""
    if netloc.startswith("["):
        end = netloc.find("]")
        if end < 0:
            return netloc, None
        host, after = netloc[:end + 1], netloc[end + 1:]
        if not after:
            return host, None
        if not after.startswith(":"):
            return netloc, None  # check_host refuses it
        return host, after[1:]
    host, colon, port = netloc.rpartition(":")
    return (host, port) if colon else (netloc, None)
