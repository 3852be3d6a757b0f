"""Finds references to other hosts (a CDN, a font service) in a page, a script or a stylesheet, so a test can prove
the chat page works offline. Each function returns the offending references it found; an empty list means none.

What counts as remote: a URL with an authority (`scheme://host`, any scheme) or a protocol-relative `//host` where a
URL is read (an HTML attribute, a CSS url() or @import, a JS string), and an http(s)/ws(s)/ftp URL anywhere inside a
JS or CSS string. Comments are not references: a `// comment` in a script is not a protocol-relative URL.
"""

from __future__ import annotations

import re
from html.parser import HTMLParser

_STARTS_REMOTE = re.compile(r"\s*(?:[a-z][a-z0-9+.-]*:)?//[^\s/]", re.I)  # "https://host", "//host"
_EMBEDDED_URL = re.compile(r"\b(?:https?|wss?|ftp)://", re.I)  # "see https://host" inside a longer string


def is_remote(value: str) -> bool:
    value = value.replace("\\/", "/")  # JSON-style escaped slashes: "https:\/\/host"
    return bool(_STARTS_REMOTE.match(value) or _EMBEDDED_URL.search(value))


def in_css(text: str) -> list[str]:
    """url(...) values, @import targets and string literals of a stylesheet that point elsewhere."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    values = [m.group(2) for m in re.finditer(r"""url\(\s*(["']?)(.*?)\1\s*\)""", text, re.I)]
    values += [m.group(2) for m in re.finditer(r"""(["'])((?:\\.|(?!\1).)*)\1""", text)]
    return [value for value in values if is_remote(value)]


# A `/` after one of these (or at the start) begins a regex literal, not a division.
_BEFORE_REGEX = set("(,=:[!&|?{};+-*%<>~^") | {""}


def _js_literals(text: str) -> list[str]:
    """The contents of a script's string and template literals, its comments and regex literals left out. A
    lexer, not a parser: enough to tell `"a"; // note` (a comment) from `"//host"` (a URL)."""
    literals, i, previous = [], 0, ""
    while i < len(text):
        char, pair = text[i], text[i : i + 2]
        if pair == "//":
            end = text.find("\n", i)
            i = len(text) if end < 0 else end
        elif pair == "/*":
            end = text.find("*/", i + 2)
            i = len(text) if end < 0 else end + 2
        elif char in "\"'`" or (char == "/" and previous in _BEFORE_REGEX):
            start, i, in_class = i + 1, i + 1, False
            while i < len(text) and (text[i] != char or in_class):
                if text[i] == "\\":
                    i += 1
                elif char == "/":  # a `/` inside a regex's [...] does not end it
                    in_class = (in_class or text[i] == "[") and text[i] != "]"
                i += 1
            if char != "/":  # a regex literal is matched against, never fetched
                literals.append(text[start:i])
            i, previous = i + 1, "literal"
        else:
            previous = previous if char.isspace() else char
            i += 1
    return literals


def in_js(text: str) -> list[str]:
    """String and template literals of a script that point elsewhere (import, fetch, a src set in code);
    CSS inside a literal (`"url(//host/x.png)"`) counts too."""
    return [literal for literal in _js_literals(text) if is_remote(literal) or in_css(literal)]


class _Page(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.found: list[str] = []
        self._open: list[str] = []  # the element whose text handle_data gets (script, style)

    def handle_starttag(self, tag, attrs):
        self._open.append(tag)
        for name, value in attrs:
            if value is None or name == "xmlns" or name.startswith("xmlns:"):  # a namespace name is not fetched
                continue
            if name == "style":
                self.found += in_css(value)
            elif name.startswith("on"):  # an event handler is a script
                self.found += in_js(value)
            elif name in ("srcset", "imagesrcset"):  # "a.png 1x, //host/b.png 2x"
                self.found += [part for part in value.split(",") if is_remote(part)]
            elif is_remote(value) or (tag == "meta" and re.search(r"url\s*=\s*['\"]?\s*//", value, re.I)):
                self.found.append(f"<{tag} {name}={value!r}>")

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        self._open.pop()

    def handle_endtag(self, tag):
        if tag in self._open:
            del self._open[len(self._open) - 1 - self._open[::-1].index(tag):]

    def handle_data(self, data):
        tag = self._open[-1] if self._open else ""
        if tag == "script":
            self.found += in_js(data)
        elif tag == "style":
            self.found += in_css(data)


def in_html(text: str) -> list[str]:
    """Attributes (src, href, srcset, style, on*, meta refresh ...), inline scripts and inline styles of a page
    that point elsewhere."""
    page = _Page()
    page.feed(text)
    page.close()
    return page.found
