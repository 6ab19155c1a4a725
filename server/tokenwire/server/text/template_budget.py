"""A chat template's rendering within a budget of time and of text built, which no expression escapes.

A chat template comes with model files the operator may not have written, and runs on input the
caller chose. Jinja's sandbox stops it from reaching Python, not from spending the machine: one
`9 ** (9 ** 9)`, `'%0300000000d' | format(1)` or a string doubled by `~` in a loop is seconds of
one uninterruptible operation, or gigabytes, and Jinja folds constant expressions when it
compiles, so such a template can stall the server before its first request. Here:

- nothing is folded at compile time (the optimizer is off, and no output is made constant), so
  every expression runs at render time, through the checks below;
- each rendering has a budget of characters it may build (RenderBudget.chars_left: 262,144, or
  16 per character of its input where that is more) and of CPU time (20 ms plus 20 us per input
  character, at most 1 s; the rendering thread's own time, so a busy machine does not fail a
  quiet template);
- every operation that can make something larger than its operands is sized before it runs:
  `*`, `+`, `%` (printf widths and precisions included, `*` widths from the arguments), `**`
  and `*` on integers (their bits), `~`, every filter (with `center`, `indent`, `wordwrap`,
  `replace`, `join`, `format`, `tojson`, `batch` and `sum` by their own arguments), the string
  methods that pad, join, replace or translate, `str.format` (its fields' widths) and each piece
  of output; an operation whose result would not fit what is left is refused before it runs,
  and what it built is charged;
- the time budget is checked at every operation, call, attribute or item lookup, loop step
  (`for` over anything, `range`) and piece of output, so a loop that does nothing still ends;
- `lipsum`, which writes text by the paragraph, is not offered.

A value's size is its weight: a string's length, a container's items' weights plus their
separators, an integer's decimal digits. Weights of containers already seen are kept for the
rendering, so sizing an operation costs in proportion to what is new in it.
"""

from __future__ import annotations

import functools
import math
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedFormatter, safe_range
from jinja2.utils import Namespace, _PassArg

DEFAULT_RENDER_SECONDS = 1.0
"""Most CPU seconds a rendering may take, however large its input."""
BASE_RENDER_SECONDS = 0.02
"""CPU seconds any rendering may take: 20 times what a small conversation takes..."""
RENDER_SECONDS_PER_INPUT_CHARACTER = 20e-6
"""...and this much more per character (weight) of its input."""
DEFAULT_MAX_OUTPUT_CHARS = 4_000_000
"""Longest prompt text a rendering may write."""
BASE_BUILD_CHARS = 1 << 18
"""Text any rendering may build (262,144 characters: a small conversation's template builds a few
thousand)..."""
BUILD_CHARS_PER_INPUT_CHARACTER = 16
"""...or per character of its input, where that is more (the copies of the messages a template
makes as it joins them)."""
CHECKS_PER_CLOCK_READ = 32
MAX_INT_BITS = 10_000
"""Largest integer a template may make (about 3,000 digits; Python prints at most 4,300)."""
CONTAINER_ITEM = 4
"""Weight of each item of a container beyond its own: the separators its text needs."""
REPR_FACTOR = 12
"""How much longer a container's text (repr, JSON) may be than its weight: escapes such as
"\\ud83d\\ude00" for one character."""


class ChatTemplateError(ValueError):
    """The template rejected the conversation (e.g. roles out of order) or failed on it."""


class ChatTemplateLimitError(ChatTemplateError):
    """Rendering this conversation ran past the template's time budget or output bound."""


def _scalar_weight(value: object) -> int | None:
    """The weight of a value without parts, or None for a container."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, bool) or value is None:
        return 5
    if isinstance(value, int):
        return value.bit_length() * 3 // 10 + 2
    if isinstance(value, float):
        return 24
    if isinstance(value, list | tuple | set | frozenset | Mapping | Namespace):
        return None
    return 16  # functions, macros, loops, undefined: their text is short


def _parts(value: object) -> list[object]:
    if isinstance(value, Mapping):
        return [part for item in value.items() for part in item]
    if isinstance(value, Namespace):
        return _parts(value._Namespace__attrs)
    assert isinstance(value, list | tuple | set | frozenset)
    return list(value)


class RenderBudget:
    """What one rendering may still spend: CPU time on its thread, and characters of text."""

    def __init__(self, *, cpu_seconds: float, max_chars: int, max_output_chars: int) -> None:
        self.deadline = time.thread_time() + cpu_seconds
        self._checks = 0
        self.max_chars = max_chars
        self.chars_left = max_chars
        self.max_output_chars = max_output_chars
        self._weights: dict[int, tuple[object, int]] = {}

    @classmethod
    def for_input(
        cls, context: Mapping[str, object], *, max_seconds: float, max_output_chars: int
    ) -> RenderBudget:
        """The budget of a rendering of `context`: it grows with the input, to the bounds."""
        unbounded = cls(cpu_seconds=math.inf, max_chars=1 << 62, max_output_chars=max_output_chars)
        size = unbounded.weight(dict(context))
        return cls(
            cpu_seconds=min(max_seconds, BASE_RENDER_SECONDS + RENDER_SECONDS_PER_INPUT_CHARACTER * size),
            max_chars=max(BASE_BUILD_CHARS, BUILD_CHARS_PER_INPUT_CHARACTER * size),
            max_output_chars=max_output_chars,
        )

    def check(self) -> None:
        # Reading a thread's CPU clock is a system call: read it every CHECKS_PER_CLOCK_READ
        # checks (each operation between two reads is itself bounded in size).
        self._checks += 1
        if self._checks % CHECKS_PER_CLOCK_READ == 0 and time.thread_time() > self.deadline:
            raise ChatTemplateLimitError("the chat template ran past its time budget for these messages")

    def refuse(self) -> ChatTemplateLimitError:
        return ChatTemplateLimitError(
            f"the chat template would build text longer than {self.max_chars} characters"
        )

    def fits(self, chars: int) -> None:
        """Raise unless `chars` more characters fit what is left; nothing is charged."""
        if chars > self.chars_left:
            raise self.refuse()

    def charge(self, chars: int) -> None:
        self.fits(chars)
        self.chars_left -= chars

    def produced(self, value: Any, weight: int | None = None) -> Any:
        """Charge `value`, just built, and keep its weight (computed unless given)."""
        if weight is None:
            weight = self.weight(value)
        elif _scalar_weight(value) is None:
            self._weights[id(value)] = (value, weight)
        self.charge(weight)
        return value

    def weight(self, value: object) -> int:
        """`value`'s weight; containers are walked once per rendering (without recursion)."""
        scalar = _scalar_weight(value)
        if scalar is not None:
            return scalar
        known = self._weights
        pending: list[tuple[object, bool]] = [(value, False)]
        open_now: set[int] = set()
        while pending:
            item, parts_done = pending.pop()
            key = id(item)
            if parts_done:
                open_now.discard(key)
                total = 2
                for part in _parts(item):
                    part_weight = _scalar_weight(part)
                    if part_weight is None:
                        part_weight = known[id(part)][1] if id(part) in known else 0  # 0: a cycle
                    total += part_weight + CONTAINER_ITEM
                known[key] = (item, total)
                continue
            if key in known or key in open_now:
                continue
            open_now.add(key)
            pending.append((item, True))
            pending.extend((part, False) for part in _parts(item) if _scalar_weight(part) is None)
        return known[id(value)][1]

    def text_weight(self, value: object) -> int:
        """Most characters str(value) may have."""
        if isinstance(value, str):
            return len(value)
        return self.weight(value) * (REPR_FACTOR if _scalar_weight(value) is None else 1)


# -- sizing the operations that build text -----------------------------------------------------------

_PRINTF = re.compile(r"%(?:\(([^)]*)\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?(.)", re.DOTALL)
_NUMBERS = re.compile(r"\d+")


def _number(text: str, budget: RenderBudget) -> int:
    if len(text) > 18:  # more digits than any width that fits a budget
        raise budget.refuse()
    return int(text)


def printf_size(budget: RenderBudget, template: str, values: object) -> int:
    """Most characters `template % values` may have."""
    positional = list(values) if isinstance(values, tuple) else [values]
    mapping = values if isinstance(values, Mapping) else None
    total = len(template)
    for match in _PRINTF.finditer(template):
        key, width_text, precision_text, conversion = match.groups()
        if conversion == "%":
            total += 1
            continue
        sizes = []
        for text in (width_text, precision_text):
            if text == "*":
                star = positional.pop(0) if positional else 0
                sizes.append(abs(star) if isinstance(star, int) else 0)
            elif text is not None:
                sizes.append(_number(text, budget))
        if mapping is not None and key is not None:
            value = mapping.get(key)
        else:
            value = positional.pop(0) if positional else None
        factor = REPR_FACTOR if conversion in "ra" else 1
        total += max([*sizes, 0]) + factor * budget.text_weight(value) + 2
    return total


class _CheckedFormatter(SandboxedFormatter):
    """The sandbox's str.format, each field's width and precision sized before it is written."""

    def __init__(self, environment: BudgetedSandbox) -> None:
        super().__init__(environment)
        self._budget_of = environment.budget

    def format_field(self, value: Any, format_spec: str) -> Any:
        budget = self._budget_of()
        budget.check()
        widths = [_number(text, budget) for text in _NUMBERS.findall(format_spec)]
        budget.fits(max([*widths, 0]) + budget.text_weight(value))
        return budget.produced(super().format_field(value, format_spec))


def _arguments(args: tuple[Any, ...], kwargs: dict[str, Any], name: str, position: int, default: Any) -> Any:
    if len(args) > position:
        return args[position]
    return kwargs.get(name, default)


def _int_argument(
    args: tuple[Any, ...], kwargs: dict[str, Any], name: str, position: int, default: int
) -> int:
    value = _arguments(args, kwargs, name, position, default)
    return value if isinstance(value, int) else default


_FILTER_FACTORS = {
    **dict.fromkeys(
        (
            "length",
            "count",
            "first",
            "last",
            "default",
            "d",
            "int",
            "float",
            "abs",
            "round",
            "attr",
            "items",
            "sort",
            "reverse",
            "unique",
            "dictsort",
            "groupby",
            "select",
            "reject",
            "selectattr",
            "rejectattr",
            "map",
            "slice",
            "min",
            "max",
            "random",
            "safe",
            "trim",
            "truncate",
            "striptags",
            "wordcount",
            "filesizeformat",
            "lower",
            "title",
            "capitalize",
        ),
        0,
    ),
    "upper": 3,
    "list": 1 + CONTAINER_ITEM,
    **dict.fromkeys(("escape", "e", "forceescape", "urlencode", "xmlattr"), 6),
}
"""Filters that build at most this many times their value's weight: 0 for those that build no
more than they are given (their result is still charged). Any other filter: REPR_FACTOR."""


def _filter_size(name: str, budget: RenderBudget, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Most characters the filter `name` may build from these arguments (the value first)."""
    value = args[0] if args else None
    size = budget.text_weight(value)
    if name == "center":
        return max(size, _int_argument(args, kwargs, "width", 1, 80))
    if name == "indent":
        width = _arguments(args, kwargs, "width", 1, 4)
        pad = len(width) if isinstance(width, str) else width if isinstance(width, int) else 4
        return size + pad * (budget.text_weight(value) + 1)  # at most one indent per character
    if name == "wordwrap":
        wrap = _arguments(args, kwargs, "wrapstring", 3, None)
        return size + size * (len(wrap) if isinstance(wrap, str) else 2)
    if name == "replace":
        old, new = _arguments(args, kwargs, "old", 1, ""), _arguments(args, kwargs, "new", 2, "")
        return _replace_size(value, old, new)
    if name == "join":
        separator = _arguments(args, kwargs, "d", 1, "")
        items = len(value) if isinstance(value, list | tuple) else size
        return size + items * budget.text_weight(separator)
    if name == "format":
        return printf_size(budget, str(value), kwargs or tuple(args[1:]))
    if name == "tojson":
        indent = _arguments(args, kwargs, "indent", 1, None)
        pad = len(indent) if isinstance(indent, str) else indent if isinstance(indent, int) else 0
        return (REPR_FACTOR + max(pad, 0)) * budget.weight(value)
    if name == "batch":
        fill = _arguments(args, kwargs, "fill_with", 2, None)
        return size + _int_argument(args, kwargs, "linecount", 1, 1) * budget.weight(fill)
    if name == "sum":
        return size + budget.weight(_arguments(args, kwargs, "start", 2, 0))
    factor = _FILTER_FACTORS.get(name, REPR_FACTOR)
    return factor * budget.weight(value) if factor else 0


def _replace_size(text: object, old: object, new: object) -> int:
    if not isinstance(text, str) or not isinstance(old, str) or not isinstance(new, str):
        return 0
    found = len(text) + 1 if not old else text.count(old)
    return len(text) + found * len(new)


_PADDING_METHODS = frozenset({"ljust", "rjust", "center", "zfill"})


def _method_size(
    budget: RenderBudget, method: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> int | None:
    """Most characters a bound str method may build, for those that can build more than 3 times
    their string; None for the others."""
    text, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
    if not isinstance(text, str):
        return None
    if name in _PADDING_METHODS:
        width = _arguments(args, kwargs, "width", 0, 0)
        return max(len(text), width if isinstance(width, int) else 0)
    if name == "expandtabs":
        return len(text) * max(1, _int_argument(args, kwargs, "tabsize", 0, 8))
    if name == "replace":
        return _replace_size(
            text, _arguments(args, kwargs, "old", 0, ""), _arguments(args, kwargs, "new", 1, "")
        )
    if name == "join":
        items = _arguments(args, kwargs, "iterable", 0, ())
        weight = budget.weight(items) if isinstance(items, list | tuple) else budget.text_weight(items)
        count = len(items) if isinstance(items, list | tuple) else weight
        return weight + count * len(text)
    if name == "translate":
        table = _arguments(args, kwargs, "table", 0, {})
        longest = (
            max((len(v) for v in table.values() if isinstance(v, str)), default=1)
            if isinstance(table, Mapping)
            else 1
        )
        return len(text) * max(1, longest)
    return None


# -- the environment ---------------------------------------------------------------------------------


class _UnfoldedCodeGenerator(CodeGenerator):
    """Jinja's code generator, folding nothing at compile time and sizing `~` and loops at render."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._loop_iterables: set[int] = set()

    def _output_child_to_const(self, node: nodes.Expr, frame: Frame, finalize: Any) -> str:
        # Every output, literal text included, is computed at render time and goes through the
        # environment's finalize, which charges it.
        raise nodes.Impossible()

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:  # noqa: N802 - Jinja's visitor name
        self.write("environment.checked_concat((")
        for argument in node.nodes:
            self.visit(argument, frame)
            self.write(", ")
        self.write("))")

    def visit_For(self, node: nodes.For, frame: Frame) -> None:  # noqa: N802 - Jinja's visitor name
        self._loop_iterables.add(id(node.iter))
        super().visit_For(node, frame)

    def visit(self, node: nodes.Node, *args: Any, **kwargs: Any) -> Any:
        if id(node) in self._loop_iterables:
            self.write("environment.checked_iter(")
            super().visit(node, *args, **kwargs)
            self.write(")")
            return None
        return super().visit(node, *args, **kwargs)


class BudgetedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, keeping the rendering thread's RenderBudget at every step."""

    intercepted_binops = frozenset({"+", "-", "*", "/", "//", "%", "**"})
    code_generator_class = _UnfoldedCodeGenerator

    def __init__(self, budgets: threading.local, **options: Any) -> None:
        super().__init__(optimized=False, finalize=self._finalize, **options)
        self._budgets = budgets
        self.globals["range"] = self._range
        self.globals.pop("lipsum", None)
        self.filters = {name: self._checked_filter(name, f) for name, f in self.filters.items()}

    def budget(self) -> RenderBudget:
        budget: RenderBudget | None = getattr(self._budgets, "current", None)
        if budget is None:  # rendered outside ChatTemplate.render: the default bounds
            return RenderBudget(
                cpu_seconds=DEFAULT_RENDER_SECONDS,
                max_chars=DEFAULT_MAX_OUTPUT_CHARS,
                max_output_chars=DEFAULT_MAX_OUTPUT_CHARS,
            )
        return budget

    def _range(self, *args: int) -> Iterator[int]:
        budget = self.budget()
        for value in safe_range(*args):
            budget.check()
            yield value

    def checked_iter(self, iterable: Iterable[Any]) -> Iterator[Any]:
        budget = self.budget()
        for value in iterable:
            budget.check()
            yield value

    def checked_concat(self, values: tuple[Any, ...]) -> str:
        budget = self.budget()
        budget.check()
        budget.fits(sum(budget.text_weight(value) for value in values))
        return str(budget.produced("".join(map(str, values))))

    def _finalize(self, value: Any) -> Any:
        budget = self.budget()
        budget.check()
        if isinstance(value, str):
            budget.charge(len(value))
            return value
        budget.fits(budget.text_weight(value))
        return budget.produced(str(value))

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        budget = self.budget()
        budget.check()
        size = self._binop_size(budget, operator, left, right)
        if size is not None:
            budget.fits(size)
        result = super().call_binop(context, operator, left, right)
        if isinstance(result, str | list | tuple):
            budget.produced(result, size)
        return result

    def _binop_size(self, budget: RenderBudget, operator: str, left: Any, right: Any) -> int | None:
        """The weight of the result of a str, list or tuple operation; None for numbers, whose
        bits are checked here instead."""
        sequences = (str, list, tuple)
        if operator == "*":
            for sequence, count in ((left, right), (right, left)):
                if isinstance(sequence, sequences) and isinstance(count, int):
                    return max(count, 0) * budget.weight(sequence)
            if isinstance(left, int) and isinstance(right, int):
                self._fits_bits(budget, left.bit_length() + right.bit_length())
        elif operator == "+" and isinstance(left, sequences) and isinstance(right, sequences):
            return budget.weight(left) + budget.weight(right)
        elif operator == "%" and isinstance(left, str):
            return printf_size(budget, left, right)
        elif (
            operator == "**"
            and isinstance(left, int)
            and isinstance(right, int)
            and right > 0
            and abs(left) > 1
        ):
            self._fits_bits(budget, right * left.bit_length())
        return None

    @staticmethod
    def _fits_bits(budget: RenderBudget, bits: int) -> None:
        if bits > MAX_INT_BITS:
            raise ChatTemplateLimitError(
                f"the chat template would make an integer of more than {MAX_INT_BITS} bits"
            )

    def call(__self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        budget = __self.budget()
        budget.check()
        size = _method_size(budget, __obj, args, kwargs)
        if size is not None:
            budget.fits(size)
        result = super().call(__context, __obj, *args, **kwargs)
        return budget.produced(result) if isinstance(result, str | list | tuple | dict) else result

    def getattr(self, obj: Any, attribute: str) -> Any:
        self.budget().check()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        self.budget().check()
        return super().getitem(obj, argument)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        text: str = value.__self__
        formatter = _CheckedFormatter(self)
        mapping = value.__name__ == "format_map"

        def checked(*args: Any, **kwargs: Any) -> str:
            if mapping:
                if kwargs or len(args) != 1:
                    raise TypeError("format_map() takes exactly one argument")
                kwargs, args = args[0], ()
            return type(text)(formatter.vformat(text, args, kwargs))

        return functools.update_wrapper(checked, value)

    def _checked_filter(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        passes = _PassArg.from_obj(function) is not None

        @functools.wraps(function)
        def checked(*args: Any, **kwargs: Any) -> Any:
            budget = self.budget()
            budget.check()
            budget.fits(_filter_size(name, budget, args[1:] if passes else args, kwargs))
            result = function(*args, **kwargs)
            return budget.produced(result) if isinstance(result, str | list | tuple | dict) else result

        return checked
