"""A Prometheus without a server: parse /metrics scrapes, keep them, evaluate a PromQL subset (pure).

Contract. Nothing here touches sockets, threads or clocks: the caller scrapes,
hands each scrape's text to :func:`parse_exposition` and its time (seconds, any
epoch) to :meth:`Store.add`, and asks :func:`evaluate` for the value of an
expression at a time it chooses. Results are instant vectors,
``{sorted label tuple: value}``; a scalar result is ``{(): value}``.

The subset (anything else raises :class:`PromQLError` naming what was not understood):

* number literals (``1``, ``0.5``, ``1e-3``, ``Inf``, ``NaN``);
* instant selectors ``name`` and ``name{l="v", l!="v", l=~"re", l!~"re"}``: the latest
  sample in the 5-minute lookback window ``(t - 5m, t]``; regexes are fully anchored and
  a missing label matches as ``""``, as in Prometheus. A selector needs a metric name
  (``{__name__="x"}`` counts);
* range selectors ``name{...}[30s]`` (units ``ms s m h d w y``, compound like ``1m30s``), only
  as the argument of ``rate`` and ``increase``. The window is ``(t - range, t]``.
  ``increase`` is ``last - first`` and ``rate`` is ``increase / (t_last - t_first)`` over the
  samples in the window, a counter reset adding the value before it; this is the simple,
  extrapolation-free form (Prometheus extrapolates to the window's edges, so its values are
  slightly larger). Fewer than two samples: the series is absent;
* ``sum avg max min``, with ``by (...)`` or ``without (...)`` before or after the argument;
* ``histogram_quantile(q, v)`` over ``le`` buckets, as Prometheus computes it (buckets with
  equal bounds merged, counts made monotonic, linear interpolation inside the bucket, the
  highest finite bound when the rank falls in ``+Inf``); a group whose result is NaN (no
  observations, no ``+Inf`` bucket) is left out;
* ``+ - * /`` and unary minus with the usual precedence and parentheses, between scalars,
  a vector and a scalar, or two vectors matched one-to-one on all labels but the name
  (no ``on``/``ignoring``/``group_left``); ``x / 0`` is ``+Inf``, ``-Inf`` or NaN as in Prometheus.

``__name__`` is kept by a bare selector and dropped by every function, aggregation and
arithmetic. Not modelled: staleness markers (a series that leaves a scrape lingers for
the lookback), ``offset``/``@``, subqueries, comparisons, set operators.
"""

from __future__ import annotations

import bisect
import itertools
import math
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

__all__ = [
    "LOOKBACK_S",
    "ExpositionError",
    "PromQLError",
    "Store",
    "evaluate",
    "metric_names",
    "parse",
    "parse_exposition",
]

LOOKBACK_S = 300.0

Labels = tuple[tuple[str, str], ...]
Vector = dict[Labels, float]
Sample = tuple[str, dict[str, str], float]


class PromQLError(ValueError):
    """An expression outside the supported subset, malformed, or of the wrong type."""


class ExpositionError(ValueError):
    """A /metrics line that is not Prometheus text format 0.0.4."""


# --------------------------------------------------------------------------- exposition

_METRIC_NAME_RE = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME_RE = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_EXPOSITION_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}


def parse_exposition(text: str) -> list[Sample]:
    """The samples of a text-format (0.0.4) scrape as ``(name, labels, value)``; timestamps are ignored."""
    samples = []
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        try:
            samples.append(_parse_sample_line(stripped))
        except ExpositionError as exc:
            raise ExpositionError(f"line {number}: {exc}: {line!r}") from None
    return samples


def _parse_sample_line(line: str) -> Sample:
    match = _METRIC_NAME_RE.match(line)
    if not match:
        raise ExpositionError("expected a metric name")
    name, pos = match.group(), _skip_blanks(line, match.end())
    labels: dict[str, str] = {}
    if pos < len(line) and line[pos] == "{":
        labels, pos = _parse_exposition_labels(line, pos + 1)
    fields = line[pos:].split()
    if len(fields) not in (1, 2):
        raise ExpositionError("expected a value and an optional timestamp")
    return name, labels, _parse_exposition_value(fields[0])


def _parse_exposition_labels(line: str, pos: int) -> tuple[dict[str, str], int]:
    """Labels from just after ``{`` to just after ``}``."""
    labels: dict[str, str] = {}
    while True:
        pos = _skip_blanks(line, pos)
        if line.startswith("}", pos):
            return labels, pos + 1
        match = _LABEL_NAME_RE.match(line, pos)
        if not match:
            raise ExpositionError(f"expected a label name at column {pos + 1}")
        pos = _skip_blanks(line, match.end())
        if not line.startswith("=", pos):
            raise ExpositionError(f"expected '=' after label {match.group()!r}")
        pos = _skip_blanks(line, pos + 1)
        if not line.startswith('"', pos):
            raise ExpositionError(f"expected a quoted value for label {match.group()!r}")
        labels[match.group()], pos = _parse_exposition_string(line, pos + 1)
        pos = _skip_blanks(line, pos)
        if line.startswith(",", pos):
            pos += 1
        elif not line.startswith("}", pos):
            raise ExpositionError(f"expected ',' or '}}' at column {pos + 1}")


def _parse_exposition_string(line: str, pos: int) -> tuple[str, int]:
    """A label value from just after its opening quote to just after its closing one."""
    chars = []
    while pos < len(line):
        char = line[pos]
        if char == '"':
            return "".join(chars), pos + 1
        if char == "\\" and pos + 1 < len(line):
            escaped = line[pos + 1]
            chars.append(_EXPOSITION_ESCAPES.get(escaped, "\\" + escaped))
            pos += 2
            continue
        chars.append(char)
        pos += 1
    raise ExpositionError("unterminated label value")


def _parse_exposition_value(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ExpositionError(f"bad sample value {text!r}") from None


def _skip_blanks(line: str, pos: int) -> int:
    while pos < len(line) and line[pos] in " \t":
        pos += 1
    return pos


# --------------------------------------------------------------------------- store


@dataclass
class _Series:
    times_s: list[float] = field(default_factory=list)
    values: list[float] = field(default_factory=list)

    def add(self, t_s: float, value: float) -> None:
        if not self.times_s or t_s >= self.times_s[-1]:
            self.times_s.append(t_s)
            self.values.append(value)
        else:
            index = bisect.bisect_right(self.times_s, t_s)
            self.times_s.insert(index, t_s)
            self.values.insert(index, value)

    def latest(self, t_s: float, lookback_s: float) -> float | None:
        """The last value at or before ``t_s`` and after ``t_s - lookback_s``."""
        index = bisect.bisect_right(self.times_s, t_s) - 1
        if index < 0 or self.times_s[index] <= t_s - lookback_s:
            return None
        return self.values[index]

    def window(self, t_s: float, range_s: float) -> tuple[list[float], list[float]]:
        """Times and values in ``(t_s - range_s, t_s]``."""
        start = bisect.bisect_right(self.times_s, t_s - range_s)
        end = bisect.bisect_right(self.times_s, t_s)
        return self.times_s[start:end], self.values[start:end]


class Store:
    """Scraped samples over time; series keyed by ``(name, frozenset(labels))``."""

    def __init__(self) -> None:
        self.series: dict[tuple[str, frozenset[tuple[str, str]]], _Series] = {}
        self._keys_by_name: dict[str, list[frozenset[tuple[str, str]]]] = {}
        self._scrape_times_s: set[float] = set()

    def add(self, t_s: float, samples: Iterable[Sample], extra_labels: Mapping[str, str] | None = None) -> None:
        """One scrape at ``t_s``; ``extra_labels`` (the target's, e.g. job and instance) go on every
        sample, a scraped label of the same name moving to ``exported_<name>`` as Prometheus does."""
        self._scrape_times_s.add(t_s)
        for name, labels, value in samples:
            key = frozenset(_with_target_labels(labels, extra_labels or {}).items())
            series = self.series.get((name, key))
            if series is None:
                series = self.series[(name, key)] = _Series()
                self._keys_by_name.setdefault(name, []).append(key)
            series.add(t_s, value)

    @property
    def scrape_times_s(self) -> list[float]:
        """The distinct times passed to :meth:`add`, ascending."""
        return sorted(self._scrape_times_s)

    def names(self) -> set[str]:
        return set(self._keys_by_name)

    def select(self, name: str) -> Iterator[tuple[frozenset[tuple[str, str]], _Series]]:
        for key in self._keys_by_name.get(name, ()):
            yield key, self.series[(name, key)]


def _with_target_labels(labels: Mapping[str, str], target: Mapping[str, str]) -> dict[str, str]:
    merged = dict(labels)
    for name, value in target.items():
        scraped = merged.get(name, "")
        if scraped:
            exported = "exported_" + name
            while exported in merged:
                exported = "exported_" + exported
            merged[exported] = scraped
        merged[name] = value
    return merged


# --------------------------------------------------------------------------- syntax tree


@dataclass(frozen=True)
class Number:
    value: float


@dataclass(frozen=True)
class Matcher:
    label: str
    op: str  # = != =~ !~
    value: str
    pattern: re.Pattern[str] | None = None

    def matches(self, labels: Mapping[str, str]) -> bool:
        actual = labels.get(self.label, "")
        if self.op == "=":
            return actual == self.value
        if self.op == "!=":
            return actual != self.value
        found = self.pattern is not None and self.pattern.fullmatch(actual) is not None
        return found if self.op == "=~" else not found


@dataclass(frozen=True)
class Selector:
    name: str
    matchers: tuple[Matcher, ...] = ()
    range_s: float | None = None


@dataclass(frozen=True)
class Call:
    func: str
    args: tuple[Expr, ...]


@dataclass(frozen=True)
class Aggregate:
    op: str
    arg: Expr
    grouping: tuple[str, ...] | None = None
    without: bool = False


@dataclass(frozen=True)
class Binary:
    op: str
    lhs: Expr
    rhs: Expr


@dataclass(frozen=True)
class Negate:
    arg: Expr


Expr = Number | Selector | Call | Aggregate | Binary | Negate

AGGREGATIONS = frozenset({"sum", "avg", "max", "min"})
FUNCTIONS = frozenset({"rate", "increase", "histogram_quantile"})
_UNSUPPORTED_AGGREGATIONS = frozenset(
    {"count", "stddev", "stdvar", "topk", "bottomk", "quantile", "count_values", "group", "limitk", "limit_ratio"}
)
_UNSUPPORTED_BINARY = frozenset({"==", "!=", ">", "<", ">=", "<=", "%", "^", "and", "or", "unless", "atan2"})
_MATCHING_KEYWORDS = frozenset({"on", "ignoring", "bool", "group_left", "group_right"})
_DURATION_UNITS_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0, "y": 31536000.0}
_DURATION_RE = re.compile(r"(\d+)(ms|s|m|h|d|w|y)")


# --------------------------------------------------------------------------- lexer


@dataclass(frozen=True)
class _Token:
    kind: str  # num ident str dur op eof
    text: str
    pos: int

    def is_op(self, *texts: str) -> bool:
        return self.kind == "op" and self.text in texts

    def is_ident(self, *names: str) -> bool:
        return self.kind == "ident" and self.text.lower() in names


_TOKEN_RE = re.compile(
    r"""
    (?P<blank>\s+|\#[^\n]*)
    |(?P<num>0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
    |(?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)
    |(?P<str>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*'|`[^`]*`)
    |(?P<op>=~|!~|!=|==|>=|<=|[-+*/%^=<>(){}\[\],@])
    """,
    re.VERBOSE,
)


def _tokenize(expr: str) -> list[_Token]:
    tokens, pos = [], 0
    while pos < len(expr):
        match = _TOKEN_RE.match(expr, pos)
        if not match:
            raise PromQLError(f"unexpected character {expr[pos]!r} at position {pos} in {expr!r}")
        kind, text = match.lastgroup or "", match.group()
        if kind != "blank":
            tokens.append(_Token(kind, text, pos))
        pos = match.end()
        if kind == "op" and text == "[":
            end = expr.find("]", pos)
            if end < 0:
                raise PromQLError(f"unclosed '[' at position {pos - 1} in {expr!r}")
            tokens.append(_Token("dur", expr[pos:end].strip(), pos))
            pos = end
    tokens.append(_Token("eof", "", len(expr)))
    return tokens


_STRING_ESCAPES = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v",
                   "\\": "\\", '"': '"', "'": "'"}
_STRING_ESCAPE_RE = re.compile(r"\\(x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|[0-7]{3}|.)")


def _unquote(token: _Token) -> str:
    body = token.text[1:-1]
    if token.text[0] == "`":
        return body

    def replace(match: re.Match[str]) -> str:
        escape = match.group(1)
        if escape[0] in "xuU":
            return chr(int(escape[1:], 16))
        if escape[0] in "01234567":
            return chr(int(escape, 8))
        if escape in _STRING_ESCAPES:
            return _STRING_ESCAPES[escape]
        raise PromQLError(f"unknown escape sequence '\\{escape}' in string at position {token.pos}")

    return _STRING_ESCAPE_RE.sub(replace, body)


def _parse_duration_s(token: _Token) -> float:
    text = token.text
    if ":" in text:
        raise PromQLError(f"unsupported: subquery [{text}] at position {token.pos}")
    if not text or "".join(m.group() for m in _DURATION_RE.finditer(text)) != text:
        raise PromQLError(f"bad duration [{text}] at position {token.pos}")
    return sum(int(m.group(1)) * _DURATION_UNITS_S[m.group(2)] for m in _DURATION_RE.finditer(text))


# --------------------------------------------------------------------------- parser


class _Parser:
    """Recursive descent: expr := term (('+'|'-') term)*; term := unary (('*'|'/') unary)*."""

    def __init__(self, expr: str) -> None:
        self.expr = expr
        self.tokens = _tokenize(expr)
        self.index = 0

    def peek(self) -> _Token:
        return self.tokens[self.index]

    def next(self) -> _Token:
        token = self.tokens[self.index]
        self.index = min(self.index + 1, len(self.tokens) - 1)
        return token

    def fail(self, message: str, token: _Token | None = None) -> PromQLError:
        token = token or self.peek()
        return PromQLError(f"{message} at position {token.pos} in {self.expr!r}")

    def expect_op(self, text: str) -> _Token:
        token = self.next()
        if not token.is_op(text):
            raise self.fail(f"expected {text!r}, found {_describe(token)}", token)
        return token

    def parse(self) -> Expr:
        node = self.expression()
        token = self.peek()
        if token.is_ident("offset") or token.is_op("@"):
            raise self.fail(f"unsupported modifier {token.text!r}")
        if token.kind != "eof":
            raise self.fail(f"unexpected {_describe(token)}")
        _check_range_selectors(node, allowed=False, parser=self)
        return node

    def expression(self) -> Expr:
        node = self.term()
        while self.peek().is_op("+", "-"):
            op = self.next().text
            self.reject_matching_keyword()
            node = Binary(op, node, self.term())
        token = self.peek()
        if (token.kind == "op" and token.text in _UNSUPPORTED_BINARY) or (
            token.kind == "ident" and token.text.lower() in _UNSUPPORTED_BINARY
        ):
            raise self.fail(f"unsupported binary operator {token.text!r}")
        return node

    def term(self) -> Expr:
        node = self.unary()
        while self.peek().is_op("*", "/"):
            op = self.next().text
            self.reject_matching_keyword()
            node = Binary(op, node, self.unary())
        return node

    def reject_matching_keyword(self) -> None:
        token = self.peek()
        if token.kind == "ident" and token.text.lower() in _MATCHING_KEYWORDS:
            raise self.fail(f"unsupported vector matching modifier {token.text!r}")

    def unary(self) -> Expr:
        if self.peek().is_op("+", "-"):
            op = self.next().text
            arg = self.unary()
            if op == "+":
                return arg
            return Number(-arg.value) if isinstance(arg, Number) else Negate(arg)
        return self.primary()

    def primary(self) -> Expr:
        token = self.next()
        if token.kind == "num":
            return Number(float(int(token.text, 16)) if token.text[:2].lower() == "0x" else float(token.text))
        if token.is_op("("):
            node = self.expression()
            self.expect_op(")")
            if self.peek().is_op("["):
                raise self.fail("unsupported: subquery")
            return node
        if token.is_op("{"):
            return self.selector(None)
        if token.kind == "ident":
            return self.identifier(token)
        if token.kind == "str":
            raise self.fail("string literals are only supported inside label matchers", token)
        raise self.fail(f"unexpected {_describe(token)}", token)

    def identifier(self, token: _Token) -> Expr:
        lowered = token.text.lower()
        if lowered in ("inf", "nan"):
            return Number(float(lowered))
        if lowered in AGGREGATIONS:
            return self.aggregation(lowered)
        if lowered in _UNSUPPORTED_AGGREGATIONS:
            raise self.fail(f"unsupported aggregation {token.text!r}", token)
        if self.peek().is_op("("):
            if token.text in FUNCTIONS:
                return self.call(token.text)
            raise self.fail(f"unsupported function {token.text!r}", token)
        return self.selector(token.text)

    def aggregation(self, op: str) -> Aggregate:
        grouping, without = self.grouping()
        self.expect_op("(")
        arg = self.expression()
        if self.peek().is_op(","):
            raise self.fail(f"unsupported: a parameter to {op}")
        self.expect_op(")")
        if grouping is None:
            grouping, without = self.grouping()
        elif self.peek().is_ident("by", "without"):
            raise self.fail(f"{op} has two grouping clauses")
        return Aggregate(op, arg, grouping, without)

    def grouping(self) -> tuple[tuple[str, ...] | None, bool]:
        if not self.peek().is_ident("by", "without"):
            return None, False
        without = self.next().text.lower() == "without"
        self.expect_op("(")
        labels = []
        while not self.peek().is_op(")"):
            token = self.next()
            if token.kind != "ident" or not _LABEL_NAME_RE.fullmatch(token.text):
                raise self.fail(f"expected a label name, found {_describe(token)}", token)
            labels.append(token.text)
            if not self.peek().is_op(")"):
                self.expect_op(",")
        self.next()
        return tuple(labels), without

    def call(self, func: str) -> Call:
        self.expect_op("(")
        args: list[Expr] = []
        while not self.peek().is_op(")"):
            args.append(self.expression())
            if not self.peek().is_op(")"):
                self.expect_op(",")
        self.next()
        arity = 2 if func == "histogram_quantile" else 1
        if len(args) != arity:
            raise self.fail(f"{func} takes {arity} argument(s), got {len(args)}")
        if func in ("rate", "increase") and not (isinstance(args[0], Selector) and args[0].range_s is not None):
            raise self.fail(f"{func} needs a range selector such as x[1m]")
        return Call(func, tuple(args))

    def selector(self, name: str | None) -> Selector:
        matchers: list[Matcher] = []
        if name is None or self.peek().is_op("{"):
            if name is not None:
                self.next()
            matchers = self.matchers()
        name = self.selector_name(name, matchers)
        range_s = None
        if self.peek().is_op("["):
            self.next()
            range_s = _parse_duration_s(self.next())
            self.expect_op("]")
        token = self.peek()
        if token.is_ident("offset") or token.is_op("@"):
            raise self.fail(f"unsupported modifier {token.text!r}")
        return Selector(name, tuple(matchers), range_s)

    def selector_name(self, name: str | None, matchers: list[Matcher]) -> str:
        named = [m for m in matchers if m.label == "__name__"]
        if name is not None:
            if named:
                raise self.fail(f"metric name {name!r} set twice")
            return name
        equal = [m for m in named if m.op == "="]
        if not equal:
            raise self.fail('unsupported: a selector without a metric name (write name{...} or {__name__="name"})')
        matchers.remove(equal[0])
        return equal[0].value

    def matchers(self) -> list[Matcher]:
        matchers = []
        while not self.peek().is_op("}"):
            label = self.next()
            if label.kind != "ident" or not _LABEL_NAME_RE.fullmatch(label.text):
                raise self.fail(f"expected a label name, found {_describe(label)}", label)
            op = self.next()
            if not op.is_op("=", "!=", "=~", "!~"):
                raise self.fail(f"expected a label matcher operator, found {_describe(op)}", op)
            value = self.next()
            if value.kind != "str":
                raise self.fail(f"expected a quoted string, found {_describe(value)}", value)
            matchers.append(self.matcher(label.text, op.text, _unquote(value)))
            if not self.peek().is_op("}"):
                self.expect_op(",")
        self.next()
        return matchers

    def matcher(self, label: str, op: str, value: str) -> Matcher:
        if op in ("=", "!="):
            return Matcher(label, op, value)
        try:
            return Matcher(label, op, value, re.compile(value))
        except re.error as exc:
            raise self.fail(f"bad regex {value!r} ({exc})") from None


def _describe(token: _Token) -> str:
    return "end of input" if token.kind == "eof" else repr(token.text)


def _check_range_selectors(node: Expr, *, allowed: bool, parser: _Parser) -> None:
    if isinstance(node, Selector):
        if node.range_s is not None and not allowed:
            raise parser.fail(f"unsupported: range selector {node.name}[...] outside rate() or increase()")
        return
    children: tuple[Expr, ...] = ()
    if isinstance(node, Call):
        children = node.args
    elif isinstance(node, Aggregate | Negate):
        children = (node.arg,)
    elif isinstance(node, Binary):
        children = (node.lhs, node.rhs)
    for child in children:
        range_ok = isinstance(node, Call) and node.func in ("rate", "increase")
        _check_range_selectors(child, allowed=range_ok, parser=parser)


def parse(expr: str) -> Expr:
    """The syntax tree of ``expr``; :class:`PromQLError` outside the subset."""
    if not isinstance(expr, str) or not expr.strip():
        raise PromQLError(f"empty or non-string expression {expr!r}")
    return _Parser(expr).parse()


def metric_names(expr: str | Expr) -> set[str]:
    """The metric names the expression selects."""
    node = parse(expr) if isinstance(expr, str) else expr
    if isinstance(node, Selector):
        return {node.name}
    if isinstance(node, Call):
        return set().union(*(metric_names(arg) for arg in node.args))
    if isinstance(node, Aggregate | Negate):
        return metric_names(node.arg)
    if isinstance(node, Binary):
        return metric_names(node.lhs) | metric_names(node.rhs)
    return set()


# --------------------------------------------------------------------------- evaluation


def evaluate(expr: str | Expr, store: Store, t_s: float) -> Vector:
    """The instant vector of ``expr`` (a string or a :func:`parse` tree) at ``t_s``; a scalar is ``{(): value}``."""
    node = parse(expr) if isinstance(expr, str) else expr
    value = _eval(node, store, t_s)
    return value if isinstance(value, dict) else {(): value}


def _eval(node: Expr, store: Store, t_s: float) -> float | Vector:
    if isinstance(node, Number):
        return node.value
    if isinstance(node, Selector):
        return _instant(node, store, t_s)
    if isinstance(node, Call):
        return _call(node, store, t_s)
    if isinstance(node, Aggregate):
        return _aggregate(node.op, _vector(node.arg, store, t_s, node.op), node.grouping, node.without)
    if isinstance(node, Negate):
        value = _eval(node.arg, store, t_s)
        return {_drop_name(k): -v for k, v in value.items()} if isinstance(value, dict) else -value
    if isinstance(node, Binary):
        return _binary(node.op, _eval(node.lhs, store, t_s), _eval(node.rhs, store, t_s))
    raise PromQLError(f"cannot evaluate {node!r}")


def _vector(node: Expr, store: Store, t_s: float, where: str) -> Vector:
    value = _eval(node, store, t_s)
    if not isinstance(value, dict):
        raise PromQLError(f"{where} expects an instant vector, got a scalar")
    return value


def _selected(selector: Selector, store: Store) -> Iterator[tuple[Labels, _Series]]:
    for key, series in store.select(selector.name):
        labels = dict(key)
        labels["__name__"] = selector.name
        if all(m.matches(labels) for m in selector.matchers):
            yield tuple(sorted(labels.items())), series


def _instant(selector: Selector, store: Store, t_s: float) -> Vector:
    out = {}
    for labels, series in _selected(selector, store):
        value = series.latest(t_s, LOOKBACK_S)
        if value is not None:
            out[labels] = value
    return out


def _call(node: Call, store: Store, t_s: float) -> Vector:
    if node.func in ("rate", "increase"):
        selector = node.args[0]
        assert isinstance(selector, Selector) and selector.range_s is not None  # checked by the parser
        return _counter_function(node.func, selector, store, t_s)
    quantile = _eval(node.args[0], store, t_s)
    if isinstance(quantile, dict):
        raise PromQLError("histogram_quantile expects a scalar quantile, got a vector")
    return _histogram_quantile(quantile, _vector(node.args[1], store, t_s, "histogram_quantile"))


def _counter_function(func: str, selector: Selector, store: Store, t_s: float) -> Vector:
    out = {}
    for labels, series in _selected(selector, store):
        times_s, values = series.window(t_s, selector.range_s or 0.0)
        if len(values) < 2 or times_s[-1] <= times_s[0]:
            continue
        increase = _counter_increase(values)
        out[_drop_name(labels)] = increase if func == "increase" else increase / (times_s[-1] - times_s[0])
    return out


def _counter_increase(values: list[float]) -> float:
    """``last - first``, each counter reset (a drop) adding the value before it."""
    total = values[-1] - values[0]
    for previous, current in itertools.pairwise(values):
        if current < previous:
            total += previous
    return total


def _histogram_quantile(q: float, buckets: Vector) -> Vector:
    groups: dict[Labels, list[tuple[float, float]]] = {}
    for labels, count in buckets.items():
        le = dict(labels).get("le")
        try:
            bound = float(le) if le is not None else None
        except ValueError:
            bound = None
        if bound is None:
            continue
        key = tuple(item for item in labels if item[0] not in ("le", "__name__"))
        groups.setdefault(key, []).append((bound, count))
    out = {}
    for key, group in groups.items():
        value = _bucket_quantile(q, group)
        if not math.isnan(value):
            out[key] = value
    return out


def _bucket_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus's bucketQuantile over ``(upper bound, cumulative count)`` pairs."""
    if math.isnan(q):
        return math.nan
    if q < 0:
        return -math.inf
    if q > 1:
        return math.inf
    merged: dict[float, float] = {}
    for bound, count in buckets:
        merged[bound] = merged.get(bound, 0.0) + count
    bounds = sorted(merged)
    counts = [merged[b] for b in bounds]
    for i in range(1, len(counts)):  # ensure monotonic, as Prometheus does for scrape skew
        counts[i] = max(counts[i], counts[i - 1])
    if len(bounds) < 2 or not math.isinf(bounds[-1]) or counts[-1] <= 0:
        return math.nan
    rank = q * counts[-1]
    b = bisect.bisect_left(counts, rank)
    if b == len(bounds) - 1:
        return bounds[-2]
    if b == 0 and bounds[0] <= 0:
        return bounds[0]
    start, end, count = 0.0, bounds[b], counts[b]
    if b > 0:
        start, count, rank = bounds[b - 1], count - counts[b - 1], rank - counts[b - 1]
    return start + (end - start) * (rank / count) if count > 0 else math.nan  # Go's 0/0


def _aggregate(op: str, vector: Vector, grouping: tuple[str, ...] | None, without: bool) -> Vector:
    groups: dict[Labels, list[float]] = {}
    for labels, value in vector.items():
        groups.setdefault(_group_key(labels, grouping, without), []).append(value)
    return {key: _reduce(op, values) for key, values in groups.items()}


def _group_key(labels: Labels, grouping: tuple[str, ...] | None, without: bool) -> Labels:
    if grouping is None:
        return ()
    if without:
        return tuple(item for item in labels if item[0] not in grouping and item[0] != "__name__")
    return tuple(item for item in labels if item[0] in grouping)


def _reduce(op: str, values: list[float]) -> float:
    if op == "sum":
        return sum(values)
    if op == "avg":
        return _reduce("sum", values) / len(values)
    numbers = [v for v in values if not math.isnan(v)]  # max/min skip NaN unless all are NaN
    if not numbers:
        return math.nan
    return max(numbers) if op == "max" else min(numbers)


def _binary(op: str, lhs: float | Vector, rhs: float | Vector) -> float | Vector:
    if not isinstance(lhs, dict) and not isinstance(rhs, dict):
        return _arithmetic(op, lhs, rhs)
    if not isinstance(rhs, dict):
        assert isinstance(lhs, dict)
        return {_drop_name(k): _arithmetic(op, v, rhs) for k, v in lhs.items()}
    if not isinstance(lhs, dict):
        return {_drop_name(k): _arithmetic(op, lhs, v) for k, v in rhs.items()}
    right = _by_signature(rhs, "right")
    out = {}
    for key, value in _by_signature(lhs, "left").items():
        if key in right:
            out[key] = _arithmetic(op, value, right[key])
    return out


def _by_signature(vector: Vector, side: str) -> Vector:
    """The vector keyed by its labels without the name; one-to-one matching needs them unique."""
    out: Vector = {}
    for labels, value in vector.items():
        key = _drop_name(labels)
        if key in out:
            raise PromQLError(f"many-to-one matching unsupported: duplicate series {dict(key)} on the {side} side")
        out[key] = value
    return out


def _arithmetic(op: str, lhs: float, rhs: float) -> float:
    if op == "+":
        return lhs + rhs
    if op == "-":
        return lhs - rhs
    if op == "*":
        return lhs * rhs
    if rhs == 0:
        if lhs == 0 or math.isnan(lhs):
            return math.nan
        return math.copysign(math.inf, lhs) * math.copysign(1.0, rhs)
    return lhs / rhs


def _drop_name(labels: Labels) -> Labels:
    return tuple(item for item in labels if item[0] != "__name__")
