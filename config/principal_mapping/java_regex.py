"""java.util.regex, as far as Kafka's ssl.principal.mapping.rules need it, on Python's `re`.

Why its own module: Kafka's rules are Java regular expressions matched with Java's semantics
(`matches()`, `replaceAll`, `$n` references, Java's '.', '$' and whitespace classes); translating
them is a job apart from reading certificates and from Kafka's rule grammar (both in
protocol/tls_identity.py). Constructs without an exact Python equivalent raise
UnsupportedJavaRegex instead of matching differently.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

#: Java's '.' without DOTALL: anything but a line terminator (Pattern.DOT()).
JAVA_DOT = "[^\\n\\r\\x85\\u2028\\u2029]"
#: Java's \s without UNICODE_CHARACTER_CLASS (ASCII.isSpace); Python's ASCII \s is the same set.
JAVA_SPACE = "[ \\t\\n\\x0b\\f\\r]"
#: Java's '$' (and \Z) without MULTILINE: the end, or before a final line terminator, never inside "\r\n".
JAVA_DOLLAR = "(?:\\Z|(?=\\r\\n\\Z)|(?<!\\r)(?=\\n\\Z)|(?=[\\r\\x85\\u2028\\u2029]\\Z))"
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


class JavaSyntaxError(Exception):
    """Pattern.compile would throw PatternSyntaxException."""


class UnsupportedJavaRegex(Exception):
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
                raise JavaSyntaxError("Unmatched closing ')'")
            raise JavaSyntaxError("Unexpected internal error")
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
                node = JAVA_DOLLAR
            elif char == ".":
                self._pos += 1
                node = "(?s:.)" if "s" in self._flags else JAVA_DOT
            elif char in "?*+":
                raise JavaSyntaxError(f"Dangling meta character '{char}'")
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
            raise JavaSyntaxError("Illegal repetition")
        low = 0
        while self._peek() in _ASCII_DIGITS:
            low = low * 10 + int(self._read())
            if low > _JAVA_MAX_REPS:
                raise JavaSyntaxError("Illegal repetition range")
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
                        raise JavaSyntaxError("Illegal repetition range")
        if self._peek() != "}":
            raise JavaSyntaxError("Unclosed counted closure")
        self._pos += 1
        if high is not None and high < low:
            raise JavaSyntaxError("Illegal repetition range")
        return f"{{{low},}}" if high is None else f"{{{low},{high}}}"

    def _group(self) -> str | None:
        """Pattern.group0: every '(' form. None for a bare flag group such as (?i)."""
        self._pos += 1
        self._depth += 1
        if self._depth > MAX_PATTERN_NESTING:
            raise UnsupportedJavaRegex(f"groups nested more than {MAX_PATTERN_NESTING} deep")
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
                        raise JavaSyntaxError(f"Named capturing group <{name}> is already defined")
                    self._groups += 1
                    number = self._groups
                    self._names[name] = number
                    opener = f"(?P<{name}>"
            elif kind in ("$", "@"):
                raise JavaSyntaxError("Unknown group type")
            else:
                self._pos -= 1
                self._inline_flags()
                end = self._read()
                if end == ")":
                    self._depth -= 1
                    return None  # the flags stay on for the rest of the enclosing group, as in Java
                if end != ":":
                    raise JavaSyntaxError("Unknown inline modifier")
                opener = "(?:"
        else:
            self._groups += 1
            number = self._groups
            opener = "("
        body = self._expr()
        if self._read() != ")":
            raise JavaSyntaxError("Unclosed group")
        if number is not None:
            self._closed.add(number)
        self._flags = saved_flags
        self._depth -= 1
        return self._closure(f"{opener}{body})")

    def _group_name(self, first: str) -> str:
        if first not in _ASCII_LETTERS:
            raise JavaSyntaxError("capturing group name does not start with a Latin letter")
        name = first
        while self._peek() in _ASCII_ALNUM:
            name += self._read()
        if self._read() != ">":
            raise JavaSyntaxError("named capturing group is missing trailing '>'")
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
                        raise UnsupportedJavaRegex(f"the inline flag (?{char})")
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
            raise UnsupportedJavaRegex(f"the Unicode property class \\{follower}")
        self._pos += 1
        return self._escape(in_class=False, in_range=False)

    def _escape(self, *, in_class: bool, in_range: bool) -> str | _Escape:
        """Pattern.escape, the backslash already consumed: a character, or a node."""
        if self._pos >= len(self._chars):
            raise JavaSyntaxError("Unescaped trailing backslash")
        char = self._read()
        if char == "0":
            return self._octal()
        if char in "123456789":
            if in_class:
                raise JavaSyntaxError("Illegal/unsupported escape sequence")
            return self._back_reference(int(char))
        if char in _ILLEGAL_ESCAPES or char in ("P", "p"):
            raise JavaSyntaxError("Illegal/unsupported escape sequence")
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
                raise JavaSyntaxError("Illegal/unsupported escape sequence")
            if char == "A":
                return _Escape("\\A")
            if char == "z":
                return _Escape("\\Z")
            if char == "Z":
                return _Escape(JAVA_DOLLAR)
            if char == "k":
                return self._named_back_reference()
            raise UnsupportedJavaRegex(f"\\{char}")
        if char == "N":
            raise UnsupportedJavaRegex("\\N{...}")
        simple = {"a": "\x07", "e": "\x1b", "f": "\x0c", "n": "\n", "r": "\r", "t": "\t"}
        if char in simple:
            return simple[char]
        if char == "c":
            if self._pos >= len(self._chars):
                raise JavaSyntaxError("Illegal control escape sequence")
            return chr(ord(self._read()) ^ 64)
        if char == "u":
            return self._unicode()
        if char == "x":
            return self._hex()
        return char  # any other non-letter stands for itself

    def _octal(self) -> str:
        first = self._read()
        if first not in _OCTAL_DIGITS or not first:
            raise JavaSyntaxError("Illegal octal escape sequence")
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
                    raise JavaSyntaxError("Hexadecimal codepoint is too big")
            if digit != "}":
                raise JavaSyntaxError("Unclosed hexadecimal escape sequence")
            return chr(value)
        raise JavaSyntaxError("Illegal hexadecimal escape sequence")

    def _four_hex(self) -> int:
        value = 0
        for _ in range(4):
            digit = self._read()
            if not digit or digit not in _HEX_DIGITS:
                raise JavaSyntaxError("Illegal Unicode escape sequence")
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
            raise UnsupportedJavaRegex(
                f"the back reference \\{number} to a group that is not closed before it")
        reference = f"(?:\\{number})"
        return _Escape(f"(?i:{reference})" if self._ci else reference)

    def _named_back_reference(self) -> _Escape:
        if self._read() != "<":
            raise JavaSyntaxError("\\k is not followed by '<' for named capturing group")
        name = self._group_name(self._read())
        if name not in self._names:
            raise JavaSyntaxError(f"named capturing group <{name}> does not exist")
        if self._names[name] not in self._closed:
            raise UnsupportedJavaRegex(
                f"the back reference \\k<{name}> to a group that is not closed before it")
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
                raise JavaSyntaxError("Unclosed character class")
            if char == "[":
                raise UnsupportedJavaRegex("a character class inside a character class")
            if char == "&" and self._peek(1) == "&":
                raise UnsupportedJavaRegex("a character class intersection (&&)")
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
                raise UnsupportedJavaRegex(f"the Unicode property class \\{follower}")
            in_range = self._peek(2) == "-"
            self._pos += 1
            escaped = self._escape(in_class=True, in_range=in_range)
            if isinstance(escaped, _Escape):
                if escaped.in_class is None:
                    raise UnsupportedJavaRegex("a negated \\H or \\V inside a character class")
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
                        raise JavaSyntaxError("Illegal character range")
                    high = end
                else:
                    high = self._read()
                    if not high:
                        raise JavaSyntaxError("Illegal character range")
                if high < low:
                    raise JavaSyntaxError("Illegal character range")
                return f"{_class_char(low)}-{_class_char(high)}"
        return _class_char(low)


def java_regex(pattern: str) -> re.Pattern[str]:
    """Pattern.compile(pattern), as a Python pattern of the same meaning; raises the two internal errors."""
    python = _JavaRegexTranslator(pattern).translate()
    try:
        return re.compile(python, re.ASCII)
    except (re.error, OverflowError, RecursionError) as exc:
        raise UnsupportedJavaRegex(f"a construct Python's re cannot compile as written ({exc})") from exc


def java_find_all(pattern: re.Pattern[str], text: str) -> Iterator[re.Match[str]]:
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


def java_trim(text: str) -> str:
    """String.trim(): strips every character up to U+0020 from both ends (not Unicode whitespace)."""
    start, end = 0, len(text)
    while start < end and text[start] <= " ":
        start += 1
    while end > start and text[end - 1] <= " ":
        end -= 1
    return text[start:end]


class ReplacementFailed(Exception):
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
                raise ReplacementFailed("character to be escaped is missing")
            out.append(replacement[index])
            index += 1
        elif char == "$":
            index += 1
            if index == len(replacement):
                raise ReplacementFailed("Illegal group reference: group index is missing")
            char = replacement[index]
            if char == "{":
                index += 1
                name = ""
                while index < len(replacement) and replacement[index] in _ASCII_ALNUM:
                    name += replacement[index]
                    index += 1
                if not name:
                    raise ReplacementFailed("named capturing group has 0 length name")
                if index == len(replacement) or replacement[index] != "}":
                    raise ReplacementFailed("named capturing group is missing trailing '}'")
                if name[0] in _ASCII_DIGITS:
                    raise ReplacementFailed(f"capturing group name {{{name}}} starts with digit character")
                if name not in match.re.groupindex:
                    raise ReplacementFailed(f"No group with name {{{name}}}")
                number = match.re.groupindex[name]
                index += 1
            else:
                if char not in _ASCII_DIGITS:
                    raise ReplacementFailed("Illegal group reference")
                number = int(char)
                index += 1
                while index < len(replacement) and replacement[index] in _ASCII_DIGITS:
                    longer = number * 10 + int(replacement[index])
                    if groups < longer:
                        break
                    number = longer
                    index += 1
            if number > groups:
                raise ReplacementFailed(f"No group {number}")
            value = match.group(number)
            if value is not None:
                out.append(value)
        else:
            out.append(char)
            index += 1
    return "".join(out)


def java_replace_all(pattern: re.Pattern[str], text: str, replacement: str) -> str:
    """String.replaceAll(regex, replacement), with Java's find() stepping over empty matches."""
    out: list[str] = []
    appended = 0
    for match in java_find_all(pattern, text):
        out.append(text[appended:match.start()])
        out.append(_expand_replacement(replacement, match))
        appended = match.end()
    out.append(text[appended:])
    return "".join(out)


#: SslPrincipalMapper.Rule.BACK_REFERENCE_PATTERN, "\$(\d+)" with Java's ASCII \d.
_BACK_REFERENCE = re.compile(r"\$([0-9]+)")


def escape_literal_back_references(replacement: str, groups: int) -> str:
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
            raise ReplacementFailed(f"For input string: \"{digits}\"")  # Integer.parseInt
        while number > groups and number >= 10:
            number //= 10
        if number > groups:
            at = reference.start(1) - 1
            value = value[:at] + "\\" + value[at:]
    return value
