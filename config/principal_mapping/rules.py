"""Kafka's ``ssl.principal.mapping.rules``: a TLS client's subject DN to its principal name.

The quotas and ACLs the brokers enforce are written against those names, so the proxy must produce
the very same string: this is a port of Kafka's ``SslPrincipalMapper`` and of the parts of
``java.util.regex`` its rules rely on (``java_regex``), checked against Kafka 4.3's own class.
No verified peer certificate is ``ANONYMOUS``; otherwise the subject (``protocol.tls_identity``)
goes through the rules, whose first match gives the name, and no matching rule makes the broker
close the connection.

It lives in ``config/`` beside the ``[tls]`` settings that hold the rules: it is configuration of
identities, not the wire protocol. Where Java cannot be followed exactly, the choice is to refuse
rather than to guess a name:

* A rule's pattern is a *Java* regular expression. It is translated to Python's ``re`` construct by
  construct; the constructs whose Java meaning Python cannot reproduce exactly (``\\b`` and ``\\B``,
  whose meaning even changed between JDK 17 and 19, ``\\p{..}``, class unions and intersections
  ``[a[b]]`` ``[a&&b]``, ``\\G``, ``\\R``, ``\\X``, ``\\N{..}``, the flags ``m d u x c U``, back
  references to groups not closed yet, lookbehinds Python cannot bound) make
  :meth:`SslPrincipalMapper.parse` raise :class:`UnsupportedPrincipalMappingRule`: a configuration
  error at start, not a wrong name later.
* Java strings are UTF-16 and Python's are code points; the two differ only where Java would split a
  surrogate pair (an empty regex match inside a character outside the BMP, or a replacement that
  mixes such a character with an out-of-range ``$n``), i.e. where Java produces a broken string.
* The ``L`` and ``U`` flags use Python's ``str.lower``/``upper``, Java ``toLowerCase``/``toUpperCase``
  (Locale.ENGLISH): the same full Unicode mappings, but each from its own Unicode version (a letter
  newer than one of them is left alone by it), and Java decides a Greek final sigma with word
  boundaries that miss a cased letter outside the BMP just before the sigma.

Pure: strings in, a name (or ``None``: refuse the connection) out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from protocol.sasl import ANONYMOUS
from protocol.tls_identity import distinguished_name

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

__all__ = [
    "ANONYMOUS",
    "DEFAULT_MAPPER",
    "DEFAULT_SSL_PRINCIPAL_MAPPING_RULES",
    "PrincipalMappingError",
    "SslPrincipalMapper",
    "UnsupportedPrincipalMappingRule",
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
