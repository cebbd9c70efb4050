"""The regular expressions of an adapter's settings, and a bound on the work of matching them.

PEFT matches ``target_modules`` and ``exclude_modules`` strings with ``re.fullmatch`` over module names, each
``rank_pattern`` / ``alpha_pattern`` key inside ``(.*\\.)?(KEY)$`` and each ``layers_pattern`` inside
``(?:^|.*?\\.)PATTERN\\.(?P<idx>\\d+)\\.`` with ``re.match``; :func:`regexes` lists them as they run. Python's
``re`` backtracks, so a pattern such as ``(.+)+X`` takes about 2^40 steps on a 41-character module name: PEFT runs
it without bound. :func:`check_patterns` bounds the steps before anything is matched: it walks the parsed pattern
and counts, for the longest of the names it will be matched against, how many ways each piece can match that a
match of the rest could follow (a repeat of one character class ends only where the next piece can start, a
repeated group multiplies its ways per iteration, an alternation of branches with disjoint first characters has
one way at a time); a pattern whose count exceeds :data:`MAX_STEPS` per name is refused, naming it, and so are
settings whose patterns together exceed :data:`MAX_TOTAL_STEPS` over all the names (thousands of rank_pattern keys,
say), naming the costliest. The count is an upper bound on the paths the backtracking matcher explores, taken over
the characters the names hold (each character at most as often as in the name holding it most), so a pattern it
admits cannot run away on them.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable

from flodl_hf.core.errors import AdapterError

try:  # Python 3.11+; sre_parse before (deprecated there)
    from re import _constants as _C, _parser as _P
except ImportError:  # pragma: no cover
    import sre_constants as _C  # type: ignore[no-redef]
    import sre_parse as _P  # type: ignore[no-redef]

ALL_LINEAR = "all-linear"   # PEFT's INCLUDE_LINEAR_LAYERS_SHORTHAND: not a regular expression
MAX_PATTERN_LENGTH = 65536  # characters of one pattern (a generated alternation of module names may be long)
MAX_STEPS = 10**5           # the bound on the backtracking paths of one pattern over one name
MAX_TOTAL_STEPS = 10**8     # ... and of all the settings' patterns over all the names (about a second)

_REPEATS = tuple(getattr(_C, n) for n in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT") if hasattr(_C, n))
_POSSESSIVE = getattr(_C, "POSSESSIVE_REPEAT", None)
_ATOMIC = getattr(_C, "ATOMIC_GROUP", None)
_CHAR_OPS = (_C.LITERAL, _C.NOT_LITERAL, _C.ANY, _C.IN)
_CATEGORIES = {_C.CATEGORY_DIGIT: r"\d", _C.CATEGORY_NOT_DIGIT: r"\D", _C.CATEGORY_SPACE: r"\s",
               _C.CATEGORY_NOT_SPACE: r"\S", _C.CATEGORY_WORD: r"\w", _C.CATEGORY_NOT_WORD: r"\W"}
_CHAR_FLAGS = re.IGNORECASE | re.DOTALL | re.ASCII | re.UNICODE


def rank_regex(key: str) -> str:
    """What PEFT's ``get_pattern_key`` matches a ``rank_pattern`` / ``alpha_pattern`` key with (``re.match``)."""
    return rf"(.*\.)?({key})$"


def layer_regex(pattern: str) -> str:
    """What PEFT's ``check_target_module_exists`` matches a ``layers_pattern`` entry with (``re.match``)."""
    return rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\."


def regexes(values: dict[str, Any]) -> list[tuple[str, str, str, bool]]:
    """Every regular expression of the settings ``values`` (target_modules, exclude_modules, rank_pattern,
    alpha_pattern, layers_pattern; absent or of another type: none): ``(field, pattern as given, regex as PEFT
    runs it, whether it must match the whole name)``."""
    out: list[tuple[str, str, str, bool]] = []
    for name in ("target_modules", "exclude_modules"):
        value = values.get(name)
        if isinstance(value, str) and not (name == "target_modules" and value.lower() == ALL_LINEAR):
            out.append((name, value, value, True))
    for name in ("rank_pattern", "alpha_pattern"):
        value = values.get(name)
        if isinstance(value, dict):
            out += [(name, key, rank_regex(key), False) for key in value if isinstance(key, str)]
    value = values.get("layers_pattern")
    for pattern in [value] if isinstance(value, str) else value if isinstance(value, list) else []:
        if isinstance(pattern, str):
            out.append(("layers_pattern", pattern, layer_regex(pattern), False))
    return out


def compile_problem(regex: str) -> str | None:
    """Why ``regex`` cannot be used (too long, or not a valid regular expression for Python's re), as a phrase;
    None when it compiles."""
    if len(regex) > MAX_PATTERN_LENGTH:
        return f"a regular expression of {len(regex)} characters (at most {MAX_PATTERN_LENGTH} are taken)"
    try:
        re.compile(regex)
    except (re.error, OverflowError, RecursionError, ValueError) as exc:
        return f"not a valid regular expression ({type(exc).__name__}: {exc})"
    return None


def check_patterns(values: dict[str, Any], names: Iterable[str], where: str,
                   error: type[Exception] = AdapterError) -> None:
    """Refuse (``error`` naming ``where``, the field and the pattern) any regular expression of ``values`` that
    does not compile or whose matching over ``names`` (the strings it will be matched against) could take more
    than :data:`MAX_STEPS` backtracking paths per name, or :data:`MAX_TOTAL_STEPS` with the others over all names."""
    names = list(names)
    profile = _Profile.of(names)
    total, costliest = 0.0, (0.0, "", "")
    for name, given, regex, whole in regexes(values):
        problem = compile_problem(regex)
        if problem is None:
            parsed = _P.parse(regex)
            try:
                steps = _Walk(profile, parsed.state.flags).bound(parsed, whole)
            except RecursionError:
                steps = math.inf
            if not steps <= MAX_STEPS:  # NaN too
                problem = (f"whose matching could backtrack without bound: up to {steps:.3g} steps per module name "
                           f"here (names of up to {profile.length} characters), over the limit of {MAX_STEPS:.0e}; "
                           "the usual cause is a repeated group around another repeat or an ambiguous alternation "
                           "('(.+)+', '(a|a)*'), or many '.*' in a row; write it without one (e.g. "
                           "'.*\\.(query|value)') or list the module names")
            else:
                total += steps * len(names)
                costliest = max(costliest, (steps, name, given))
                if total > MAX_TOTAL_STEPS:
                    _, name, given = costliest
                    problem = (f"the costliest of the settings' regular expressions, which together could take up "
                               f"to {total:.3g} backtracking steps over the {len(names)} names here, over the limit "
                               f"of {MAX_TOTAL_STEPS:.0e}; use fewer patterns, or list the module names")
        if problem:
            what = "has a key" if name in ("rank_pattern", "alpha_pattern") else "holds"
            raise error(f"{where}: field {name!r} {what} {_show(given)}, {problem}")


def _show(value: Any) -> str:
    text = repr(value)
    return (text[:77] + "...") if len(text) > 80 else text


# ---- the bound ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Profile:
    """What the bound needs of the names: the longest's length, and each character's largest count in one."""

    length: int
    counts: dict[str, int]

    @staticmethod
    def of(names: Iterable[str]) -> "_Profile":
        length, counts = 0, Counter()
        for name in names:
            length = max(length, len(name))
            counts |= Counter(name)   # the largest count of each character in one name
        return _Profile(length, dict(counts))

    def occurrences(self, chars: frozenset[str]) -> int:
        """At most how often a character of ``chars`` occurs in one name."""
        return min(self.length, sum(self.counts[c] for c in chars))


@dataclass(frozen=True)
class _Next:
    """What may come right after a piece in a successful match: a character of ``chars``, the end of the name
    (``end``), or anything (``any``: not known)."""

    chars: frozenset[str] = frozenset()
    end: bool = False
    any: bool = False

    def __or__(self, other: "_Next") -> "_Next":
        return _Next(self.chars | other.chars, self.end or other.end, self.any or other.any)


_END = _Next(end=True)
_ANYTHING = _Next(any=True)
_NOTHING = _Next()


class _Walk:
    """One pattern's bound: (ways, steps) of each piece given what may follow it. ``ways`` bounds the distinct
    matches of the piece that the rest can follow (each is a path the rest is tried on), ``steps`` the work of
    enumerating them; a sequence's steps are each piece's steps times the ways of the pieces before it."""

    def __init__(self, profile: _Profile, flags: int) -> None:
        self.profile = profile
        self.flags = flags
        self.length = profile.length
        self._chars: dict[tuple[str, int], frozenset[str]] = {}
        self._first: dict[int, tuple[_Next, bool]] = {}

    def bound(self, parsed: Any, whole: bool) -> float:
        """The steps of matching the parsed pattern from the start of a name (to its end when ``whole``)."""
        return self.sequence(parsed, self.flags, _END if whole else _ANYTHING)[1]

    # -- the characters a one-character piece matches, among those the names hold
    def chars(self, op: Any, av: Any, flags: int) -> frozenset[str]:
        source = _char_source(op, av)
        if source is None:
            return frozenset(self.profile.counts)
        flags &= _CHAR_FLAGS
        if flags & re.ASCII:
            flags &= ~re.UNICODE
        key = (source, flags)
        if key not in self._chars:
            compiled = re.compile(source, flags)
            self._chars[key] = frozenset(c for c in self.profile.counts if compiled.fullmatch(c))
        return self._chars[key]

    # -- what a piece can start with, and whether it can match the empty string
    def first(self, items: list, flags: int) -> tuple[_Next, bool]:
        out = _NOTHING
        for op, av in items:
            start, empty = self.first_of(op, av, flags)
            out = out | start
            if not empty:
                return out, False
        return out, True

    def first_of(self, op: Any, av: Any, flags: int) -> tuple[_Next, bool]:
        key = id(av) if av is not None and not isinstance(av, int) else None
        if key is not None and key in self._first:
            return self._first[key]
        if op in _CHAR_OPS:
            result = _Next(self.chars(op, av, flags)), False
        elif op is _C.AT and av is _C.AT_END:          # $: the end, or a newline (before the end)
            result = _Next(frozenset("\n") & frozenset(self.profile.counts), end=True), False
        elif op is _C.AT and av is _C.AT_END_STRING:   # \Z
            result = _END, False
        elif op is _C.SUBPATTERN:
            result = self.first(av[3], _scoped(flags, av))
        elif op is _ATOMIC:
            result = self.first(av, flags)
        elif op is _C.BRANCH:
            parts = [self.first(alt, flags) for alt in av[1]]
            result = _union(p[0] for p in parts), any(p[1] for p in parts)
        elif op in _REPEATS:
            start, empty = self.first(av[2], flags)
            result = (start, True) if av[1] == 0 else (start, empty or av[0] == 0)
        elif op is _C.GROUPREF_EXISTS:
            yes = self.first(av[1], flags)
            no = self.first(av[2], flags) if av[2] is not None else (_NOTHING, True)
            result = yes[0] | no[0], yes[1] or no[1]
        elif op in (_C.AT, _C.ASSERT, _C.ASSERT_NOT):  # zero-width: what follows decides
            result = _NOTHING, True
        else:  # a back reference (anything), or an op this walk does not know
            result = _ANYTHING, True
        if key is not None:
            self._first[key] = result
        return result

    # -- ways and steps
    def sequence(self, items: list, flags: int, follow: _Next) -> tuple[float, float]:
        nexts = [follow] * len(items)
        after = follow
        for i in range(len(items) - 1, -1, -1):
            nexts[i] = after
            start, empty = self.first_of(*items[i], flags)
            after = (start | after) if empty else start
        ways, steps = 1.0, 0.0
        for (op, av), nxt in zip(items, nexts):
            w, s = self.piece(op, av, flags, nxt)
            steps += _times(ways, s)
            ways = _times(ways, w)
            if ways == 0 or steps == math.inf:
                break
        return ways, steps

    def piece(self, op: Any, av: Any, flags: int, follow: _Next) -> tuple[float, float]:
        if op in _CHAR_OPS:
            return (1.0 if self.chars(op, av, flags) else 0.0), 1.0
        if op is _C.AT:
            return 1.0, 1.0
        if op is _C.SUBPATTERN:
            return self.sequence(av[3], _scoped(flags, av), follow)
        if op is _ATOMIC:  # the first match only
            ways, steps = self.sequence(av, flags, _ANYTHING)
            return min(ways, 1.0), steps
        if op in (_C.ASSERT, _C.ASSERT_NOT):
            return 1.0, self.sequence(av[1], flags, _ANYTHING)[1]
        if op is _C.BRANCH:
            parts = [self.sequence(alt, flags, follow) for alt in av[1]]
            starts = [self.first(alt, flags) for alt in av[1]]
            chars = [start.chars for start, _ in starts]
            # branches that start with different characters: at most one of them matches at a given position
            disjoint = (not any(empty or start.any or start.end for start, empty in starts)
                        and sum(map(len, chars)) == len(frozenset().union(*chars)))
            ways = max(p[0] for p in parts) if disjoint else sum(p[0] for p in parts)
            return ways, sum(p[1] for p in parts)
        if op is _C.GROUPREF_EXISTS:
            yes = self.sequence(av[1], flags, follow)
            no = self.sequence(av[2], flags, follow) if av[2] is not None else (1.0, 1.0)
            return yes[0] + no[0], yes[1] + no[1]
        if op in _REPEATS:
            return self.repeat(op, av, flags, follow)
        return 1.0, float(self.length + 1)   # a back reference: one way, compared character by character

    def repeat(self, op: Any, av: Any, flags: int, follow: _Next) -> tuple[float, float]:
        low, high, body = av
        n = self.length
        if len(body) == 1 and body[0][0] in _CHAR_OPS:  # one character class, repeated
            chars = self.chars(*body[0], flags)
            if not chars:
                return (1.0 if low == 0 else 0.0), 1.0
            tries = max(0, min(high, n) - low + 1)
            if op is _POSSESSIVE or follow.any:
                ways = min(tries, 1) if op is _POSSESSIVE else tries
            else:  # it can end only where what follows can start: inside the run, or just after it
                ways = min(tries, self.profile.occurrences(follow.chars & chars) + 1)
            return float(ways), float(tries + 1)
        start, empty = self.first(body, flags)
        # a possessive repeat is atomic: each iteration's first match is taken, whatever follows
        ways_one, steps_one = self.sequence(body, flags, _ANYTHING if op is _POSSESSIVE else start | follow)
        if ways_one == 0:
            return (1.0 if low == 0 else 0.0), steps_one
        if ways_one == math.inf or steps_one == math.inf:
            return math.inf, math.inf
        if empty or start.any or start.end:
            count = min(high, n + 1)
        else:  # each iteration starts with one of the body's first characters
            count = min(high, self.profile.occurrences(start.chars))
        if low > count:
            if not empty:
                return 0.0, (count + 1) * steps_one
            count = low   # empty iterations up to the minimum
        if op is _POSSESSIVE:
            return 1.0, (count + 1) * steps_one
        if ways_one == 1:
            return float(count - low + 1), (count + 1) * steps_one
        paths = _geometric(ways_one, count)
        if paths == math.inf:
            return math.inf, math.inf
        return paths - _geometric(ways_one, low - 1), paths * steps_one


def _times(a: float, b: float) -> float:
    """a * b, with 0 * inf = 0 (a piece never reached costs nothing)."""
    return 0.0 if a == 0 or b == 0 else a * b


def _geometric(ratio: float, last: int) -> float:
    """1 + ratio + ... + ratio ** last (0 when last < 0), math.inf past float range."""
    if last < 0:
        return 0.0
    if ratio == math.inf:
        return math.inf
    try:
        return (ratio ** (last + 1) - 1) / (ratio - 1)
    except OverflowError:
        return math.inf


def _union(parts: Iterable[_Next]) -> _Next:
    out = _NOTHING
    for part in parts:
        out = out | part
    return out


def _scoped(flags: int, av: Any) -> int:
    """The flags inside a group ``(?a-b:...)``: SUBPATTERN's (group, add_flags, del_flags, pattern)."""
    return (flags | av[1]) & ~av[2]


def _char_source(op: Any, av: Any) -> str | None:
    """A one-character piece as a regular expression of its own (None: one this walk does not know)."""
    if op is _C.ANY:
        return "."
    if op is _C.LITERAL:
        return re.escape(chr(av))
    if op is _C.NOT_LITERAL:
        return f"[^{re.escape(chr(av))}]"
    parts = []
    for item_op, item in av:
        if item_op is _C.NEGATE:
            parts.append("^")
        elif item_op is _C.LITERAL:
            parts.append(re.escape(chr(item)))
        elif item_op is _C.RANGE:
            parts.append(f"{re.escape(chr(item[0]))}-{re.escape(chr(item[1]))}")
        elif item_op is _C.CATEGORY and item in _CATEGORIES:
            parts.append(_CATEGORIES[item])
        else:
            return None
    return f"[{''.join(parts)}]"
