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
# java.util.regex, as far as mapping rules need it.
# --------------------------------------------------------------------------------------------------

#: Java's '.' without DOTALL: anything but a line terminator (Pattern.DOT()).
_JAVA_DOT = "[^\\n\\r\\x85\\u2028\\u2029]"
#: Java's \s without UNICODE_CHARACTER_CLASS (ASCII.isSpace); Python's ASCII \s is the same set.
_JAVA_SPACE = "[ \\t\\n\\x0b\\f\\r]"
#: Java's '$' (and \Z) without MULTILINE: the end, or before a final line terminator, never inside "\r\n".
_JAVA_DOLLAR = "(?:\\Z|(?=\\r\\n\\Z)|(?<!\\r)(?=\\n\\Z)|(?=[\\r\\x85\\u2028\\u2029]\\Z))"
#: Pattern.HorizWS() and Pattern.VertWS(), for \h and \v.
_JAVA_HORIZONTAL_SPACE = "\\t\\x20\\xa0\\u1680\\u180e\\u2000-\\u200a\\u202f\\u205f\\u3000"
_JAVA_VERTICAL_SPACE = "\\n\\x0b\\x0c\\r\\x85\\u2028\\u2029"
#: Pattern's MAX_REPS: the largest {n,m} bound Java accepts.
_JAVA_MAX_REPS = 0x7FFFFFFF
#: Java's Integer.MAX_VALUE, past which Integer.parseInt fails (Kafka's escapeLiteralBackReferences).
_JAVA_MAX_INT = 0x7FFFFFFF
#: Deepest group nesting translated. Java's parser recurses per group too; real rules nest 2 or 3 deep.
MAX_PATTERN_NESTING = 100
#: Inline flags the translation honours: CASE_INSENSITIVE (ASCII, as Java's default) and DOTALL.
_SUPPORTED_FLAGS = frozenset("is")
_ALL_FLAGS = frozenset("imsduxcU")
_ASCII_LETTERS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_ASCII_DIGITS = frozenset("0123456789")
_ASCII_ALNUM = _ASCII_LETTERS | _ASCII_DIGITS
_HEX_DIGITS = frozenset("0123456789abcdefABCDEF")
_OCTAL_DIGITS = frozenset("01234567")
#: Letters whose escape Java rejects outright ("Illegal/unsupported escape sequence").
_ILLEGAL_ESCAPES = frozenset("CEFIJKLMOQTUYgijlmoqy")


class _JavaSyntaxError(Exception):
    """Pattern.compile would throw PatternSyntaxException."""


class _Unsupported(Exception):
    """Java accepts the construct but this translation cannot reproduce its meaning exactly."""


@dataclass(frozen=True)
class _Escape:
    """An escape that is not a single character: a class (\\d), an anchor (\\A), a back reference."""

    regex: str
    in_class: str | None = None


def _remove_qe_quoting(pattern: str) -> str:
    r"""Pattern.RemoveQEQuoting: rewrite \Q...\E as escaped characters before parsing."""
    chars = list(pattern)
    length = len(chars)
    index = 0
    while index < length - 1:
        if chars[index] != "\\":
            index += 1
        elif chars[index + 1] != "Q":
            index += 2
        else:
            break
    if index >= length - 1:
        return pattern
    out = chars[:index]
    index += 2
    in_quote = True
    begin_quote = True
    while index < length:
        char = chars[index]
        index += 1
        if not char.isascii() or char in _ASCII_LETTERS:
            out.append(char)
        elif char in _ASCII_DIGITS:
            if begin_quote:
                out.extend("\\x3")
            out.append(char)
        elif char != "\\":
            if in_quote:
                out.append("\\")
            out.append(char)
        elif in_quote:
            if index < length and chars[index] == "E":
                index += 1
                in_quote = False
            else:
                out.extend("\\\\")
        else:
            if index < length and chars[index] == "Q":
                index += 1
                in_quote = True
                begin_quote = True
                continue
            out.append(char)
            if index != length:
                out.append(chars[index])
                index += 1
        begin_quote = False
    return "".join(out)


def _class_char(char: str) -> str:
    """One character inside a Python character class, immune to its position."""
    if char.isascii() and char.isalnum():
        return char
    return f"\\U{ord(char):08x}"


class _JavaRegexTranslator:
    """Recursive descent over a Java pattern, following java.util.regex.Pattern's own parser.

    It raises where Pattern.compile throws, and emits, construct by construct, Python regex text of the
    same meaning (compiled with re.ASCII, which makes \\d \\w \\s and case folding ASCII as in Java).
    """

    def __init__(self, pattern: str) -> None:
        self._chars = _remove_qe_quoting(pattern)
        self._pos = 0
        self._flags: set[str] = set()
        #: Capturing groups opened so far (Java's capturingGroupCount - 1), and those already closed.
        self._groups = 0
        self._closed: set[int] = set()
        self._names: dict[str, int] = {}
        self._depth = 0

    # -- reading ------------------------------------------------------------------------------------
    def _peek(self, ahead: int = 0) -> str:
        index = self._pos + ahead
        return self._chars[index] if index < len(self._chars) else ""

    def _read(self) -> str:
        char = self._peek()
        self._pos += 1
        return char

    @property
    def _ci(self) -> bool:
        return "i" in self._flags

    # -- structure ----------------------------------------------------------------------------------
    def translate(self) -> str:
        body = self._expr()
        if self._pos != len(self._chars):
            if self._peek() == ")":
                raise _JavaSyntaxError("Unmatched closing ')'")
            raise _JavaSyntaxError("Unexpected internal error")
        return body

    def _expr(self) -> str:
        alternatives = [self._sequence()]
        while self._peek() == "|":
            self._pos += 1
            alternatives.append(self._sequence())
        return "|".join(alternatives)

    def _sequence(self) -> str:
        out: list[str] = []
        while True:
            char = self._peek()
            if char in ("", "|", ")"):
                return "".join(out)
            if char == "(":
                group = self._group()
                if group is not None:
                    out.append(group)
                continue
            if char == "[":
                node = self._class()
            elif char == "\\":
                escaped = self._escape_outside_class()
                node = escaped.regex if isinstance(escaped, _Escape) else self._literal(escaped)
            elif char == "^":
                self._pos += 1
                node = "\\A"
            elif char == "$":
                self._pos += 1
                node = _JAVA_DOLLAR
            elif char == ".":
                self._pos += 1
                node = "(?s:.)" if "s" in self._flags else _JAVA_DOT
            elif char in "?*+":
                raise _JavaSyntaxError(f"Dangling meta character '{char}'")
            elif char == "{":
                node = "(?:)"  # Java's atom() yields an empty slice; closure() then wants a count
            else:
                self._pos += 1
                node = self._literal(char)
            out.append(self._closure(node))

    def _literal(self, char: str) -> str:
        if self._ci and char in _ASCII_LETTERS:
            return f"[{char.lower()}{char.upper()}]"
        return re.escape(char)

    def _closure(self, node: str) -> str:
        """Pattern.closure: an optional quantifier after an atom, with its lazy/possessive suffix.

        Java also lets anchors and lookarounds be quantified; wrapped in (?:...) Python accepts them too.
        """
        char = self._peek()
        if char in ("?", "*", "+"):
            self._pos += 1
            quantifier = char
        elif char == "{":
            quantifier = self._counted()
        else:
            return node
        suffix = self._peek()
        if suffix in ("?", "+"):
            self._pos += 1
            quantifier += suffix
        return f"(?:{node}){quantifier}"

    def _counted(self) -> str:
        self._pos += 1
        if self._peek() not in _ASCII_DIGITS:
            raise _JavaSyntaxError("Illegal repetition")
        low = 0
        while self._peek() in _ASCII_DIGITS:
            low = low * 10 + int(self._read())
            if low > _JAVA_MAX_REPS:
                raise _JavaSyntaxError("Illegal repetition range")
        high: int | None = low
        if self._peek() == ",":
            self._pos += 1
            if self._peek() == "}":
                high = None
            else:
                high = 0
                while self._peek() in _ASCII_DIGITS:
                    high = high * 10 + int(self._read())
                    if high > _JAVA_MAX_REPS:
                        raise _JavaSyntaxError("Illegal repetition range")
        if self._peek() != "}":
            raise _JavaSyntaxError("Unclosed counted closure")
        self._pos += 1
        if high is not None and high < low:
            raise _JavaSyntaxError("Illegal repetition range")
        return f"{{{low},}}" if high is None else f"{{{low},{high}}}"

    def _group(self) -> str | None:
        """Pattern.group0: every '(' form. None for a bare flag group such as (?i)."""
        self._pos += 1
        self._depth += 1
        if self._depth > MAX_PATTERN_NESTING:
            raise _Unsupported(f"groups nested more than {MAX_PATTERN_NESTING} deep")
        saved_flags = set(self._flags)
        number: int | None = None
        if self._peek() == "?":
            self._pos += 1
            kind = self._read()
            if kind == ":":
                opener = "(?:"
            elif kind in ("=", "!"):
                opener = f"(?{kind}"
            elif kind == ">":
                opener = "(?>"
            elif kind == "<":
                following = self._read()
                if following in ("=", "!"):
                    opener = f"(?<{following}"
                else:
                    name = self._group_name(following)
                    if name in self._names:
                        raise _JavaSyntaxError(f"Named capturing group <{name}> is already defined")
                    self._groups += 1
                    number = self._groups
                    self._names[name] = number
                    opener = f"(?P<{name}>"
            elif kind in ("$", "@"):
                raise _JavaSyntaxError("Unknown group type")
            else:
                self._pos -= 1
                self._inline_flags()
                end = self._read()
                if end == ")":
                    self._depth -= 1
                    return None  # the flags stay on for the rest of the enclosing group, as in Java
                if end != ":":
                    raise _JavaSyntaxError("Unknown inline modifier")
                opener = "(?:"
        else:
            self._groups += 1
            number = self._groups
            opener = "("
        body = self._expr()
        if self._read() != ")":
            raise _JavaSyntaxError("Unclosed group")
        if number is not None:
            self._closed.add(number)
        self._flags = saved_flags
        self._depth -= 1
        return self._closure(f"{opener}{body})")

    def _group_name(self, first: str) -> str:
        if first not in _ASCII_LETTERS:
            raise _JavaSyntaxError("capturing group name does not start with a Latin letter")
        name = first
        while self._peek() in _ASCII_ALNUM:
            name += self._read()
        if self._read() != ">":
            raise _JavaSyntaxError("named capturing group is missing trailing '>'")
        return name

    def _inline_flags(self) -> None:
        """Pattern.addFlag / subFlag: letters to set, then optionally '-' and letters to clear."""
        on = True
        while True:
            char = self._peek()
            if char == "-" and on:
                on = False
            elif char and char in _ALL_FLAGS:
                if on:
                    if char not in _SUPPORTED_FLAGS:
                        raise _Unsupported(f"the inline flag (?{char})")
                    self._flags.add(char)
                else:
                    self._flags.discard(char)
            else:
                return
            self._pos += 1

    # -- escapes ------------------------------------------------------------------------------------
    def _escape_outside_class(self) -> str | _Escape:
        follower = self._peek(1)
        if follower in ("p", "P"):
            raise _Unsupported(f"the Unicode property class \\{follower}")
        self._pos += 1
        return self._escape(in_class=False, in_range=False)

    def _escape(self, *, in_class: bool, in_range: bool) -> str | _Escape:
        """Pattern.escape, the backslash already consumed: a character, or a node."""
        if self._pos >= len(self._chars):
            raise _JavaSyntaxError("Unescaped trailing backslash")
        char = self._read()
        if char == "0":
            return self._octal()
        if char in "123456789":
            if in_class:
                raise _JavaSyntaxError("Illegal/unsupported escape sequence")
            return self._back_reference(int(char))
        if char in _ILLEGAL_ESCAPES or char in ("P", "p"):
            raise _JavaSyntaxError("Illegal/unsupported escape sequence")
        if char in "dDsSwW":
            return _Escape(f"\\{char}", f"\\{char}")
        if char == "h":
            return _Escape(f"[{_JAVA_HORIZONTAL_SPACE}]", _JAVA_HORIZONTAL_SPACE)
        if char == "H":
            return _Escape(f"[^{_JAVA_HORIZONTAL_SPACE}]")
        if char == "v":
            if in_range:
                return "\x0b"
            return _Escape(f"[{_JAVA_VERTICAL_SPACE}]", _JAVA_VERTICAL_SPACE)
        if char == "V":
            return _Escape(f"[^{_JAVA_VERTICAL_SPACE}]")
        if char in "ABGRXZbkz":
            if in_class:
                raise _JavaSyntaxError("Illegal/unsupported escape sequence")
            if char == "A":
                return _Escape("\\A")
            if char == "z":
                return _Escape("\\Z")
            if char == "Z":
                return _Escape(_JAVA_DOLLAR)
            if char == "k":
                return self._named_back_reference()
            raise _Unsupported(f"\\{char}")
        if char == "N":
            raise _Unsupported("\\N{...}")
        simple = {"a": "\x07", "e": "\x1b", "f": "\x0c", "n": "\n", "r": "\r", "t": "\t"}
        if char in simple:
            return simple[char]
        if char == "c":
            if self._pos >= len(self._chars):
                raise _JavaSyntaxError("Illegal control escape sequence")
            return chr(ord(self._read()) ^ 64)
        if char == "u":
            return self._unicode()
        if char == "x":
            return self._hex()
        return char  # any other non-letter stands for itself

    def _octal(self) -> str:
        first = self._read()
        if first not in _OCTAL_DIGITS or not first:
            raise _JavaSyntaxError("Illegal octal escape sequence")
        second = self._peek()
        if not second or second not in _OCTAL_DIGITS:
            return chr(int(first, 8))
        self._pos += 1
        third = self._peek()
        if third and third in _OCTAL_DIGITS and first in "0123":
            self._pos += 1
            return chr(int(first + second + third, 8))
        return chr(int(first + second, 8))

    def _hex(self) -> str:
        first = self._read()
        if first and first in _HEX_DIGITS:
            second = self._read()
            if second and second in _HEX_DIGITS:
                return chr(int(first + second, 16))
        elif first == "{" and self._peek() and self._peek() in _HEX_DIGITS:
            value = 0
            while True:
                digit = self._read()
                if not digit or digit not in _HEX_DIGITS:
                    break
                value = value * 16 + int(digit, 16)
                if value > 0x10FFFF:
                    raise _JavaSyntaxError("Hexadecimal codepoint is too big")
            if digit != "}":
                raise _JavaSyntaxError("Unclosed hexadecimal escape sequence")
            return chr(value)
        raise _JavaSyntaxError("Illegal hexadecimal escape sequence")

    def _four_hex(self) -> int:
        value = 0
        for _ in range(4):
            digit = self._read()
            if not digit or digit not in _HEX_DIGITS:
                raise _JavaSyntaxError("Illegal Unicode escape sequence")
            value = value * 16 + int(digit, 16)
        return value

    def _unicode(self) -> str:
        value = self._four_hex()
        if 0xD800 <= value <= 0xDBFF:
            saved = self._pos
            if self._read() == "\\" and self._read() == "u":
                low = self._four_hex()
                if 0xDC00 <= low <= 0xDFFF:
                    return chr(0x10000 + (value - 0xD800) * 0x400 + (low - 0xDC00))
            self._pos = saved
        return chr(value)

    def _back_reference(self, number: int) -> _Escape:
        """Pattern.ref: more digits are taken only while they name a group opened so far."""
        while self._peek() and self._peek() in _ASCII_DIGITS:
            longer = number * 10 + int(self._peek())
            if self._groups < longer:
                break
            number = longer
            self._pos += 1
        if number not in self._closed:
            raise _Unsupported(f"the back reference \\{number} to a group that is not closed before it")
        reference = f"(?:\\{number})"
        return _Escape(f"(?i:{reference})" if self._ci else reference)

    def _named_back_reference(self) -> _Escape:
        if self._read() != "<":
            raise _JavaSyntaxError("\\k is not followed by '<' for named capturing group")
        name = self._group_name(self._read())
        if name not in self._names:
            raise _JavaSyntaxError(f"named capturing group <{name}> does not exist")
        if self._names[name] not in self._closed:
            raise _Unsupported(f"the back reference \\k<{name}> to a group that is not closed before it")
        reference = f"(?:(?P={name}))"
        return _Escape(f"(?i:{reference})" if self._ci else reference)

    # -- character classes --------------------------------------------------------------------------
    def _class(self) -> str:
        """Pattern.clazz without unions and intersections (refused: Python has no equivalent)."""
        self._pos += 1
        negated = False
        if self._peek() == "^":
            self._pos += 1
            negated = True
        items: list[str] = []
        while True:
            char = self._peek()
            if not char and self._pos >= len(self._chars):
                raise _JavaSyntaxError("Unclosed character class")
            if char == "[":
                raise _Unsupported("a character class inside a character class")
            if char == "&" and self._peek(1) == "&":
                raise _Unsupported("a character class intersection (&&)")
            if char == "]" and items:
                self._pos += 1
                break
            items.append(self._class_item())
        body = "".join(items)
        python = f"[{'^' if negated else ''}{body}]"
        return f"(?i:{python})" if self._ci else python

    def _class_item(self) -> str:
        """Pattern.range: one character, a range, or an escaped class such as \\d."""
        char = self._peek()
        if char == "\\":
            follower = self._peek(1)
            if follower in ("p", "P"):
                raise _Unsupported(f"the Unicode property class \\{follower}")
            in_range = self._peek(2) == "-"
            self._pos += 1
            escaped = self._escape(in_class=True, in_range=in_range)
            if isinstance(escaped, _Escape):
                if escaped.in_class is None:
                    raise _Unsupported("a negated \\H or \\V inside a character class")
                return escaped.in_class
            low = escaped
        else:
            self._pos += 1
            low = char
        if self._peek() == "-":
            after = self._peek(1)
            if after == "[":
                return _class_char(low)
            if after != "]":
                self._pos += 1
                if self._peek() == "\\":
                    self._pos += 1
                    end = self._escape(in_class=True, in_range=True)
                    if isinstance(end, _Escape):
                        raise _JavaSyntaxError("Illegal character range")
                    high = end
                else:
                    high = self._read()
                    if not high:
                        raise _JavaSyntaxError("Illegal character range")
                if high < low:
                    raise _JavaSyntaxError("Illegal character range")
                return f"{_class_char(low)}-{_class_char(high)}"
        return _class_char(low)


def _java_regex(pattern: str) -> re.Pattern[str]:
    """Pattern.compile(pattern), as a Python pattern of the same meaning; raises the two internal errors."""
    python = _JavaRegexTranslator(pattern).translate()
    try:
        return re.compile(python, re.ASCII)
    except (re.error, OverflowError, RecursionError) as exc:
        raise _Unsupported(f"a construct Python's re cannot compile as written ({exc})") from exc


def _java_find_all(pattern: re.Pattern[str], text: str) -> Iterator[re.Match[str]]:
    """Matcher.find() repeated: after an empty match the next search starts one character later."""
    first, last = -1, 0
    while True:
        start = last + 1 if last == first else last
        if start > len(text):
            return
        match = pattern.search(text, start)
        if match is None:
            return
        first, last = match.start(), match.end()
        yield match


def _java_trim(text: str) -> str:
    """String.trim(): strips every character up to U+0020 from both ends (not Unicode whitespace)."""
    start, end = 0, len(text)
    while start < end and text[start] <= " ":
        start += 1
    while end > start and text[end - 1] <= " ":
        end -= 1
    return text[start:end]


class _ReplacementFailed(Exception):
    """Matcher.appendReplacement or Integer.parseInt would throw: Kafka fails the connection."""


def _expand_replacement(replacement: str, match: re.Match[str]) -> str:
    """Matcher.appendExpandedReplacement: '\\x' is x, '$n' takes digits while a group that large exists."""
    out: list[str] = []
    groups = match.re.groups
    index = 0
    while index < len(replacement):
        char = replacement[index]
        if char == "\\":
            index += 1
            if index == len(replacement):
                raise _ReplacementFailed("character to be escaped is missing")
            out.append(replacement[index])
            index += 1
        elif char == "$":
            index += 1
            if index == len(replacement):
                raise _ReplacementFailed("Illegal group reference: group index is missing")
            char = replacement[index]
            if char == "{":
                index += 1
                name = ""
                while index < len(replacement) and replacement[index] in _ASCII_ALNUM:
                    name += replacement[index]
                    index += 1
                if not name:
                    raise _ReplacementFailed("named capturing group has 0 length name")
                if index == len(replacement) or replacement[index] != "}":
                    raise _ReplacementFailed("named capturing group is missing trailing '}'")
                if name[0] in _ASCII_DIGITS:
                    raise _ReplacementFailed(f"capturing group name {{{name}}} starts with digit character")
                if name not in match.re.groupindex:
                    raise _ReplacementFailed(f"No group with name {{{name}}}")
                number = match.re.groupindex[name]
                index += 1
            else:
                if char not in _ASCII_DIGITS:
                    raise _ReplacementFailed("Illegal group reference")
                number = int(char)
                index += 1
                while index < len(replacement) and replacement[index] in _ASCII_DIGITS:
                    longer = number * 10 + int(replacement[index])
                    if groups < longer:
                        break
                    number = longer
                    index += 1
            if number > groups:
                raise _ReplacementFailed(f"No group {number}")
            value = match.group(number)
            if value is not None:
                out.append(value)
        else:
            out.append(char)
            index += 1
    return "".join(out)


def _java_replace_all(pattern: re.Pattern[str], text: str, replacement: str) -> str:
    """String.replaceAll(regex, replacement), with Java's find() stepping over empty matches."""
    out: list[str] = []
    appended = 0
    for match in _java_find_all(pattern, text):
        out.append(text[appended:match.start()])
        out.append(_expand_replacement(replacement, match))
        appended = match.end()
    out.append(text[appended:])
    return "".join(out)


#: SslPrincipalMapper.Rule.BACK_REFERENCE_PATTERN, "\$(\d+)" with Java's ASCII \d.
_BACK_REFERENCE = re.compile(r"\$([0-9]+)")


def _escape_literal_back_references(replacement: str, groups: int) -> str:
    """SslPrincipalMapper.Rule.escapeLiteralBackReferences, quirks included.

    A `$n` naming no group (after dropping trailing digits, as Java's appendReplacement would) gets a
    backslash so Java reads it literally. Kafka finds the references in the original string but
    inserts into the growing copy, so with several such references the later backslashes land one
    character early per earlier insertion; the port keeps that, as it decides the broker's name.
    """
    if groups == 0:
        return replacement
    value = replacement
    for reference in _BACK_REFERENCE.finditer(replacement):
        digits = reference.group(1)
        if digits.startswith("0"):
            continue
        # Integer.parseInt fails past 10 digits anyway; checked before int() so a reference of
        # thousands of digits fails this connection's name, not the proxy (int() refuses > 4300).
        number = int(digits) if len(digits) <= 10 else _JAVA_MAX_INT + 1
        if number > _JAVA_MAX_INT:
            raise _ReplacementFailed(f"For input string: \"{digits}\"")  # Integer.parseInt
        while number > groups and number >= 10:
            number //= 10
        if number > groups:
            at = reference.start(1) - 1
            value = value[:at] + "\\" + value[at:]
    return value


# --------------------------------------------------------------------------------------------------
# Kafka's SslPrincipalMapper.
# --------------------------------------------------------------------------------------------------

#: SslPrincipalMapper.RULE_PATTERN with Java's '.' spelled out (it excludes every line terminator).
_RULE_PATTERN = (
    f"(DEFAULT)|RULE:((\\\\{_JAVA_DOT}|[^\\\\/])*)/((\\\\{_JAVA_DOT}|[^\\\\/])*)/([LU]?){_JAVA_DOT}*?"
    f"|({_JAVA_DOT}*?)"
)
_RULE_SPLITTER = re.compile(f"{_JAVA_SPACE}*({_RULE_PATTERN}){_JAVA_SPACE}*(,{_JAVA_SPACE}*|{_JAVA_DOLLAR})")
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
        replacement = _escape_literal_back_references(self.replacement, self.regex.groups)
        result = _java_replace_all(self.regex, name, replacement)
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
        for split in _java_find_all(_RULE_SPLITTER, _java_trim(text)):
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
            except _ReplacementFailed:
                return None
            if principal is not None:
                return principal
        return None

    def __str__(self) -> str:
        return f"SslPrincipalMapper(rules = [{', '.join(str(rule) for rule in self.rules)}])"


def _compile_rule(rule: str, pattern: str, replacement: str, flag: str) -> _Rule:
    try:
        regex = _java_regex(pattern)
    except _JavaSyntaxError as exc:
        raise PrincipalMappingError(f"Invalid rule: `{rule}`: {exc} in pattern `{pattern}`", rule) from exc
    except _Unsupported as exc:
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
