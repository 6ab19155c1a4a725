"""No expression of a chat template escapes its rendering's budget: each attack of the review (and
its relatives) is refused as ChatTemplateLimitError before it builds what it asks for, with the
rendering's memory peak (tracemalloc) a few MiB, and nothing is folded at compile time."""

from __future__ import annotations

import tracemalloc

import pytest

from tokenwire.server.text.chat import ChatTemplate, ChatTemplateError, ChatTemplateLimitError, ChatTurn

HELLO = [ChatTurn("user", "hello")]
PEAK_BYTES = 32 << 20
"""Most a refused rendering may allocate: 4,000,000 characters of text fit in 16 MiB."""

ATTACKS = {
    "printf width through format": "{{ '%0300000000d' | format(1) }}",
    "printf width through %": "{{ '%0300000000d' % 1 }}",
    "printf star width": "{{ '%*d' % (300000000, 1) }}",
    "printf precision": "{{ '%.300000000f' % 1.5 }}",
    "printf width of a thousand digits": "{{ ('%' ~ '9' * 1000 ~ 'd') % 1 }}",
    "integer power from the input": "{% set n = messages|length %}{{ (n + 8) ** (n * 6000000) }}",
    "float power": "{{ (1 + 8) ** (1 * 6e6) }}",
    "integer power of powers": "{{ 9 ** (9 ** 9) }}",
    "integer products": "{% set x = 10 ** 2000 %}{{ x * x * x * x * x * x }}",
    "doubling with ~": (
        "{% set ns = namespace(s='x' * 60000) %}"
        "{% for i in range(100) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
    ),
    "doubling with +": (
        "{% set ns = namespace(s='x' * 60000) %}"
        "{% for i in range(100) %}{% set ns.s = ns.s + ns.s %}{% endfor %}"
    ),
    "list repetition": "{{ (['x' * 100000] * 1000) | join }}",
    "nested list literals": (
        "{% set s = 'x' * 300000 %}{% set a = [s, s, s, s, s, s, s, s, s, s] %}"
        "{% set b = [a, a, a, a, a, a, a, a, a, a] %}{{ b | join }}"
    ),
    "nested list literals written out": (
        "{% set s = 'x' * 300000 %}{% set a = [s, s, s, s, s, s, s, s, s, s] %}"
        "{% set b = [a, a, a, a, a, a, a, a, a, a] %}{{ b }}"
    ),
    "nested list literals as JSON": (
        "{% set s = 'x' * 300000 %}{% set a = [s, s, s, s, s, s, s, s, s, s] %}"
        "{% set b = [a, a, a, a, a, a, a, a, a, a] %}{{ b | tojson }}"
    ),
    "nested list literals as a string": (
        "{% set s = 'x' * 300000 %}{% set a = [s, s, s, s, s, s, s, s, s, s] %}"
        "{% set b = [a, a, a, a, a, a, a, a, a, a] %}{{ b | string }}"
    ),
    "padding method": "{{ 'x'.ljust(300000000) }}",
    "centering method": "{{ 'x'.center(300000000) }}",
    "zero filling": "{{ '1'.zfill(300000000) }}",
    "tab expansion": "{{ ('\\t' * 1000).expandtabs(100000) }}",
    "replacing the empty string": "{{ ('x' * 1000).replace('', 'y' * 10000) }}",
    "replacing again and again": "{{ 'x' | replace('', 'y' * 1000) | replace('', 'y' * 1000) }}",
    "translating to long strings": "{{ ('a' * 100).translate({97: 'x' * 100000}) }}",
    "joining a list many times over": "{{ ('x' * 1000).join(['y' * 1000] * 4000) }}",
    "str.format width": "{{ '{:>300000000}'.format('x') }}",
    "str.format nested width": "{{ '{:{w}}'.format('x', w=300000000) }}",
    "format_map width": "{{ '{a:>300000000}'.format_map({'a': 'x'}) }}",
    "center filter": "{{ 'x' | center(300000000) }}",
    "indent filter": "{{ 'x' | indent(300000000, true) }}",
    "JSON indent": "{{ messages | tojson(indent=100000000) }}",
    "batch filling": "{{ [1] | batch(300000000, 'x' * 100) | list }}",
    "mapped filter": "{{ ['x'] | map('center', 300000000) | join }}",
    "summed lists": "{{ ([[1] * 1000] * 500) | sum(start=[]) }}",
    "keyword dictionary": "{{ dict(a='x' * 3000000, b='x' * 3000000) }}",
    "literal text in a loop inside a filter block": (
        "{% filter upper %}{% for i in range(100000) %}" + "x" * 200 + "{% endfor %}{% endfilter %}"
    ),
    "output captured by set": (
        "{% set x %}{% for i in range(100000) %}{{ messages[0].content * 100 }}{% endfor %}{% endset %}"
        "{{ x }}"
    ),
    "macro output in a loop": (
        "{% macro m() %}{{ 'x' * 100000 }}{% endmacro %}"
        "{% for i in range(100000) %}{% set y = m() %}{% endfor %}"
    ),
    "nested loops over a range": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    ),
    "nested loops over a string": (
        "{% set s = 'x' * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}"
    ),
    "recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
}


@pytest.mark.parametrize("source", ATTACKS.values(), ids=ATTACKS.keys())
def test_an_attack_is_refused_before_it_builds_what_it_asks_for(source: str) -> None:
    tracemalloc.start()
    try:
        template = ChatTemplate(source)
        with pytest.raises(ChatTemplateLimitError):
            template.render(HELLO)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < PEAK_BYTES, f"{peak / 2**20:.0f} MiB"


def test_lipsum_is_not_offered() -> None:
    with pytest.raises(ChatTemplateError, match="lipsum"):
        ChatTemplate("{{ lipsum(100000) }}").render(HELLO)


CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_a_conversation_at_the_largest_prompt_renders_within_its_budget() -> None:
    # 1,048,576 characters: the prompt bound of a 131,072-token context.
    turns = [ChatTurn("user" if i % 2 == 0 else "assistant", "word " * 1024) for i in range(204)]
    rendered = ChatTemplate(CHATML).render(turns)
    assert rendered.count("<|im_start|>") == 205 and len(rendered) > 1_000_000


def test_templates_of_ordinary_shapes_render_as_before() -> None:
    source = (
        "{% set sep = joiner(', ') %}{% for m in messages %}{{ sep() }}{{ m.role | upper }}: "
        "{{ '%-6s|' | format(m.role) }}{{ '{:>3}'.format(loop.index) }} {{ m.content | trim | truncate(20) }}"
        "{% endfor %}{{ messages | length }}{{ (messages | map(attribute='role') | list) | tojson }}"
        "{{ 2 ** 10 }}{{ 'ab' * 2 }}{{ [1, 2] + [3] }}{{ ' x ' ~ 7 }}"
    )
    rendered = ChatTemplate(source).render([ChatTurn("user", "  hi there  "), ChatTurn("assistant", "yo")])
    assert rendered == (
        'USER: user  |  1 hi there, ASSISTANT: assistant|  2 yo2["user", "assistant"]1024abab[1, 2, 3] x 7'
    )
