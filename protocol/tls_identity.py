"""The Kafka principal of a TLS client: its certificate's subject, mapped by ssl.principal.mapping.rules.

A broker with ``security.protocol=SSL`` names a client the way ``DefaultKafkaPrincipalBuilder`` does:
no verified peer certificate (``SSLPeerUnverifiedException``) is ``ANONYMOUS``; otherwise the subject's
``X500Principal.getName()`` (RFC 2253) goes through ``SslPrincipalMapper``, whose first matching rule
gives the name, and no matching rule makes the broker close the connection. The quotas and ACLs the
brokers enforce are written against those names, so the proxy must produce the very same string:
this module is a port of those three pieces of Java (the JDK's ``sun.security.x509.AVA`` /
``X500Name`` formatting, Kafka's ``SslPrincipalMapper``, and the parts of ``java.util.regex`` the
rules rely on), checked against a real JVM (JDK 17 and 25) and Kafka 4.3's own class.

Where Java cannot be followed exactly, the choice is to refuse rather than to guess a name:

* A rule's pattern is a *Java* regular expression. It is translated to Python's ``re`` construct by
  construct; the constructs whose Java meaning Python cannot reproduce exactly (``\\b`` and ``\\B``,
  whose meaning even changed between JDK 17 and 19, ``\\p{..}``, class unions and intersections
  ``[a[b]]`` ``[a&&b]``, ``\\G``, ``\\R``, ``\\X``, ``\\N{..}``, the flags ``m d u x c U``, back
  references to groups not closed yet, lookbehinds Python cannot bound) make
  :meth:`SslPrincipalMapper.parse` raise :class:`UnsupportedPrincipalMappingRule`: a configuration
  error at start, not a wrong name later.
* ``PrintableString``/``T61String``/``IA5String``/``GeneralString``/``BMPString`` values with
  non-ASCII content are decoded as JDK 21 and later do (ISO-8859-1, UTF-16BE). JDK 17 decodes every
  string type as UTF-8 (checked on 17.0.15), so such values, and every ``BMPString``, print
  differently on a JDK 17 broker. ``UTF8String`` (what OpenSSL, keytool and ``cryptography`` write)
  and ASCII text in any type print the same on both.
* A ``UTF8String`` or ``BMPString`` that is not well-formed UTF-8 / UTF-16 (which Java prints with
  U+FFFD replacement characters, counted its own way) makes :func:`distinguished_name` raise.
* Java strings are UTF-16 and Python's are code points; the two differ only where Java would split a
  surrogate pair (an empty regex match inside a character outside the BMP, or a replacement that
  mixes such a character with an out-of-range ``$n``), i.e. where Java produces a broken string.
* The ``L`` and ``U`` flags use Python's ``str.lower``/``upper``, Java ``toLowerCase``/``toUpperCase``
  (Locale.ENGLISH): the same full Unicode mappings, but each from its own Unicode version (a letter
  newer than one of them is left alone by it), and Java decides a Greek final sigma with word
  boundaries that miss a cased letter outside the BMP just before the sigma.

Everything here is pure: bytes and strings in, a name (or ``None``: refuse the connection) out.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

from cryptography import x509

from .java_regex import (
    JAVA_DOLLAR,
    JAVA_DOT,
    JAVA_SPACE,
    JavaSyntaxError,
    ReplacementFailed,
    UnsupportedJavaRegex,
    escape_literal_back_references,
    java_find_all,
    java_regex,
    java_replace_all,
    java_trim,
)
from .sasl import ANONYMOUS

__all__ = [
    "ANONYMOUS",
    "DEFAULT_MAPPER",
    "DEFAULT_SSL_PRINCIPAL_MAPPING_RULES",
    "PrincipalMappingError",
    "SslPrincipalMapper",
    "UnsupportedPrincipalMappingRule",
    "distinguished_name",
    "principal_from_certificate",
]

#: Kafka's BrokerSecurityConfigs.DEFAULT_SSL_PRINCIPAL_MAPPING_RULES: the whole DN is the name.
DEFAULT_SSL_PRINCIPAL_MAPPING_RULES = "DEFAULT"


class PrincipalMappingError(ValueError):
    """ssl.principal.mapping.rules Kafka rejects (IllegalArgumentException, PatternSyntaxException)."""

    def __init__(self, message: str, rule: str) -> None:
        super().__init__(message)
        #: The one rule (as split from the setting) at fault.
        self.rule = rule


class UnsupportedPrincipalMappingRule(PrincipalMappingError):
    """A rule Kafka accepts whose Java regex this port cannot match exactly as Java does."""


# --------------------------------------------------------------------------------------------------
# The subject DN, as javax.security.auth.x500.X500Principal.getName() prints it (RFC 2253).
# --------------------------------------------------------------------------------------------------

#: sun.security.x509.AVAKeyword entries flagged rfc2253Compliant; every other type prints as its OID.
RFC2253_KEYWORDS = {
    "2.5.4.3": "CN",
    "2.5.4.6": "C",
    "2.5.4.7": "L",
    "2.5.4.8": "ST",
    "2.5.4.10": "O",
    "2.5.4.11": "OU",
    "2.5.4.9": "STREET",
    "0.9.2342.19200300.100.1.25": "DC",
    "0.9.2342.19200300.100.1.1": "UID",
}

#: AVA.isDerString(value, false) string types, with the charset AVA.getCharset gives each (JDK 21+).
_STRING_TAG_CHARSETS = {
    0x13: "latin-1",  # PrintableString
    0x14: "latin-1",  # T61String
    0x16: "latin-1",  # IA5String
    0x1B: "latin-1",  # GeneralString
    0x1E: "utf-16-be",  # BMPString
    0x0C: "utf-8",  # UTF8String
}

#: Characters AVA.toRFC2253String prefixes with a backslash (RFC 2253's set plus '=' and '#').
_RFC2253_ESCAPEES = frozenset(',=+<>#;"\\')
#: AVA.toRFC2253String escapes these when leading or trailing (after the escaping above).
_RFC2253_EDGE_WHITESPACE = frozenset(" \r")

_DER_SEQUENCE = 0x30
_DER_SET = 0x31
_DER_OID = 0x06
_DER_EXPLICIT_VERSION = 0xA0
#: Longest DER length field a certificate needs (4 bytes: 4 GiB), as bounded as Java's DerInputStream.
_MAX_DER_LENGTH_BYTES = 4


def _der_element(data: bytes, offset: int) -> tuple[int, int, int]:
    """The DER element at `offset`: (tag, content start, content end). ValueError if it is not whole."""
    if offset + 2 > len(data):
        raise ValueError("truncated DER element")
    tag = data[offset]
    if tag & 0x1F == 0x1F:
        raise ValueError("multi-byte DER tags do not occur in certificate names")
    first = data[offset + 1]
    start = offset + 2
    if first < 0x80:
        length = first
    else:
        size = first & 0x7F
        if size == 0 or size > _MAX_DER_LENGTH_BYTES or start + size > len(data):
            raise ValueError("bad DER length")
        length = int.from_bytes(data[start:start + size], "big")
        start += size
    end = start + length
    if end > len(data):
        raise ValueError("truncated DER element")
    return tag, start, end


def _der_children(data: bytes, start: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """(tag, element start, content start, content end) of each element in data[start:end]."""
    offset = start
    while offset < end:
        tag, content_start, content_end = _der_element(data, offset)
        if content_end > end:
            raise ValueError("DER element overruns its parent")
        yield tag, offset, content_start, content_end
        offset = content_end


def _dotted_oid(content: bytes) -> str:
    """An OBJECT IDENTIFIER's content as Java's ObjectIdentifier.toString() prints it."""
    if not content or content[-1] & 0x80:
        raise ValueError("bad OBJECT IDENTIFIER")
    arcs: list[int] = []
    value = 0
    for byte in content:
        value = value << 7 | byte & 0x7F
        if not byte & 0x80:
            arcs.append(value)
            value = 0
    first, second = (divmod(arcs[0], 40) if arcs[0] < 80 else (2, arcs[0] - 80))
    return ".".join(str(arc) for arc in (first, second, *arcs[1:]))


def _subject(tbs: bytes) -> tuple[int, int]:
    """Where the subject Name lies in a TBSCertificate: (element start, element end)."""
    tag, start, end = _der_element(tbs, 0)
    if tag != _DER_SEQUENCE:
        raise ValueError("TBSCertificate is not a SEQUENCE")
    fields = list(_der_children(tbs, start, end))
    if fields and fields[0][0] == _DER_EXPLICIT_VERSION:
        fields = fields[1:]
    # serialNumber, signature, issuer, validity, subject
    if len(fields) < 5 or fields[4][0] != _DER_SEQUENCE:
        raise ValueError("TBSCertificate has no subject")
    _, subject_start, _, subject_end = fields[4]
    return subject_start, subject_end


def _rfc2253_string(text: str) -> str:
    """AVA.toRFC2253String's escaping of a string value (JDK 17-25 agree on it)."""
    escaped: list[str] = []
    for char in text:
        if char in _RFC2253_ESCAPEES:
            escaped.append("\\" + char)
        elif char == "\x00":
            escaped.append("\\00")
        else:
            escaped.append(char)
    chars = "".join(escaped)
    lead = 0
    while lead < len(chars) and chars[lead] in _RFC2253_EDGE_WHITESPACE:
        lead += 1
    trail = len(chars) - 1
    while trail >= 0 and chars[trail] in _RFC2253_EDGE_WHITESPACE:
        trail -= 1
    return "".join("\\" + char if index < lead or index > trail else char for index, char in enumerate(chars))


def _rfc2253_name(name: bytes) -> str:
    """X500Name.getRFC2253Name() of a DER Name: RDNs last first, AVAs in encoded order joined by '+'."""
    tag, start, end = _der_element(name, 0)
    if tag != _DER_SEQUENCE or end != len(name):
        raise ValueError("a Name is a SEQUENCE")
    rdns: list[str] = []
    for rdn_tag, _, rdn_start, rdn_end in _der_children(name, start, end):
        if rdn_tag != _DER_SET:
            raise ValueError("an RDN is a SET")
        avas: list[str] = []
        for ava_tag, _, ava_start, ava_end in _der_children(name, rdn_start, rdn_end):
            if ava_tag != _DER_SEQUENCE:
                raise ValueError("an AttributeTypeAndValue is a SEQUENCE")
            parts = list(_der_children(name, ava_start, ava_end))
            if len(parts) != 2 or parts[0][0] != _DER_OID:
                raise ValueError("an AttributeTypeAndValue is an OID and a value")
            oid = _dotted_oid(name[parts[0][2]:parts[0][3]])
            value_tag, value_start, content_start, value_end = parts[1]
            keyword = RFC2253_KEYWORDS.get(oid, oid)
            charset = _STRING_TAG_CHARSETS.get(value_tag)
            if oid not in RFC2253_KEYWORDS or charset is None:
                avas.append(f"{keyword}=#{name[value_start:value_end].hex()}")
            else:
                # Strict: Java puts U+FFFD for malformed bytes by rules of its own; refusing beats guessing.
                text = name[content_start:value_end].decode(charset)
                avas.append(f"{keyword}={_rfc2253_string(text)}")
        rdns.append("+".join(avas))
    return ",".join(reversed(rdns))


def distinguished_name(der: bytes) -> str:
    """The subject of a DER certificate exactly as Java's X500Principal.getName() prints it.

    This is the string Kafka's ssl.principal.mapping.rules are written against. ValueError if the
    certificate does not parse.
    """
    certificate = x509.load_der_x509_certificate(der)
    tbs = certificate.tbs_certificate_bytes
    start, end = _subject(tbs)
    return _rfc2253_name(tbs[start:end])


# --------------------------------------------------------------------------------------------------
# Kafka's SslPrincipalMapper.
# --------------------------------------------------------------------------------------------------

#: SslPrincipalMapper.RULE_PATTERN with Java's '.' spelled out (it excludes every line terminator).
_RULE_PATTERN = (
    f"(DEFAULT)|RULE:((\\\\{JAVA_DOT}|[^\\\\/])*)/((\\\\{JAVA_DOT}|[^\\\\/])*)/([LU]?){JAVA_DOT}*?"
    f"|({JAVA_DOT}*?)"
)
_RULE_SPLITTER = re.compile(f"{JAVA_SPACE}*({_RULE_PATTERN}){JAVA_SPACE}*(,{JAVA_SPACE}*|{JAVA_DOLLAR})")
_RULE_PARSER = re.compile(_RULE_PATTERN)


@dataclass(frozen=True)
class _Rule:
    """One of Kafka's rules: DEFAULT, or RULE:pattern/replacement/ with an optional L or U."""

    pattern: str | None = None
    replacement: str = ""
    to_lower: bool = False
    to_upper: bool = False
    regex: re.Pattern[str] | None = None

    def apply(self, name: str) -> str | None:
        """SslPrincipalMapper.Rule.apply: None when the pattern does not match the whole DN."""
        if self.regex is None:
            return name
        match = self.regex.fullmatch(name)
        if match is None:
            return None
        replacement = escape_literal_back_references(self.replacement, self.regex.groups)
        result = java_replace_all(self.regex, name, replacement)
        if self.to_lower:
            return result.lower()
        if self.to_upper:
            return result.upper()
        return result

    def __str__(self) -> str:
        if self.pattern is None:
            return "DEFAULT"
        flag = "/L" if self.to_lower else "/U" if self.to_upper else ""
        return f"RULE:{self.pattern}/{self.replacement}{flag}"


@dataclass(frozen=True)
class SslPrincipalMapper:
    """Kafka's ssl.principal.mapping.rules: turns a certificate's DN into the principal name."""

    rules: tuple[_Rule, ...]

    @classmethod
    def parse(cls, rules: str | None) -> SslPrincipalMapper:
        """SslPrincipalMapper.fromRules: accepts exactly what Kafka accepts.

        None is Kafka's default ("DEFAULT"). Raises PrincipalMappingError naming the rule Kafka would
        reject, or its subclass UnsupportedPrincipalMappingRule for a Java regex this port cannot
        reproduce exactly (see the module's docstring).
        """
        text = DEFAULT_SSL_PRINCIPAL_MAPPING_RULES if rules is None else rules
        parsed: list[_Rule] = []
        for split in java_find_all(_RULE_SPLITTER, java_trim(text)):
            rule = split.group(1)
            match = _RULE_PARSER.match(rule)
            if match is None:  # cannot happen: the last alternative matches the empty string
                raise PrincipalMappingError(f"Invalid rule: {rule}", rule)
            if match.end() != len(rule):
                raise PrincipalMappingError(
                    f"Invalid rule: `{rule}`, unmatched substring: `{rule[match.end():]}`", rule)
            if match.group(1) is not None:
                parsed.append(_Rule())
            elif match.group(2) is not None:
                parsed.append(_compile_rule(rule, match.group(2), match.group(4), match.group(6)))
            # else: an empty rule, ignored as Kafka ignores it
        return cls(tuple(parsed))

    from_rules = parse

    def name(self, distinguished_name: str) -> str | None:
        """The principal name of a DN: the first rule that matches decides.

        None where the broker fails the connection: no rule matches (Kafka's NoMatchingRule), or the
        matching rule's replacement throws in Java (e.g. "$2" with one group). The proxy must then
        refuse the connection too: the broker would never let that client in under any name.
        """
        for rule in self.rules:
            try:
                principal = rule.apply(distinguished_name)
            except ReplacementFailed:
                return None
            if principal is not None:
                return principal
        return None

    def __str__(self) -> str:
        return f"SslPrincipalMapper(rules = [{', '.join(str(rule) for rule in self.rules)}])"


def _compile_rule(rule: str, pattern: str, replacement: str, flag: str) -> _Rule:
    try:
        regex = java_regex(pattern)
    except JavaSyntaxError as exc:
        raise PrincipalMappingError(f"Invalid rule: `{rule}`: {exc} in pattern `{pattern}`", rule) from exc
    except UnsupportedJavaRegex as exc:
        raise UnsupportedPrincipalMappingRule(
            f"Rule `{rule}` is valid for Kafka, but its pattern uses {exc}, whose Java meaning "
            "kthrottle cannot reproduce exactly; rewrite the pattern without it", rule) from exc
    return _Rule(pattern, replacement, flag == "L", flag == "U", regex)


#: The mapper a listener without ssl.principal.mapping.rules uses (Kafka's default, "DEFAULT").
DEFAULT_MAPPER = SslPrincipalMapper.parse(DEFAULT_SSL_PRINCIPAL_MAPPING_RULES)


def principal_from_certificate(der: bytes | None, rules: SslPrincipalMapper | None) -> str | None:
    """The principal name a Kafka broker gives a TLS client (without "User:"), or None to refuse it.

    `der` is the client's *verified* certificate, None when it sent none (ssl.client.auth=requested or
    none): Kafka's principal is then ANONYMOUS. `rules` None means Kafka's default, DEFAULT. None
    back means the broker would close this connection (no rule matches, or the rule fails), or the
    certificate's subject could not be read; either way the client has no name to be served under.
    """
    if der is None:
        return ANONYMOUS
    try:
        subject = distinguished_name(der)
    except ValueError:
        return None
    return (DEFAULT_MAPPER if rules is None else rules).name(subject)
