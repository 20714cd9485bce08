"""The subject of a TLS client's certificate, exactly as a Kafka broker reads it.

A broker with ``security.protocol=SSL`` names a client the way ``DefaultKafkaPrincipalBuilder`` does:
the subject's ``X500Principal.getName()`` (RFC 2253), which then goes through
``ssl.principal.mapping.rules`` (``config/principal_mapping/``). This module is the port of the JDK's
``sun.security.x509.AVA`` / ``X500Name`` formatting, checked against a real JVM (JDK 17 and 25):

* ``PrintableString``/``T61String``/``IA5String``/``GeneralString``/``BMPString`` values with
  non-ASCII content are decoded as JDK 21 and later do (ISO-8859-1, UTF-16BE). JDK 17 decodes every
  string type as UTF-8 (checked on 17.0.15), so such values, and every ``BMPString``, print
  differently on a JDK 17 broker. ``UTF8String`` (what OpenSSL, keytool and ``cryptography`` write)
  and ASCII text in any type print the same on both.
* A ``UTF8String`` or ``BMPString`` that is not well-formed UTF-8 / UTF-16 (which Java prints with
  U+FFFD replacement characters, counted its own way) makes :func:`distinguished_name` raise.

Pure: DER bytes in, a string out.
"""

from __future__ import annotations

from collections.abc import Iterator

from cryptography import x509

__all__ = ["RFC2253_KEYWORDS", "distinguished_name"]


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
