"""A chat template renders within a time budget and an output bound, and fails as ChatTemplateError."""

from __future__ import annotations

import pytest

from tokenwire.server.text.chat import ChatTemplate, ChatTemplateError, ChatTemplateLimitError, ChatTurn
from tokenwire.server.text.template_budget import BASE_BUILD_CHARS

HELLO = [ChatTurn("user", "hello")]


@pytest.mark.parametrize(
    "source",
    [
        "{{ 'x' * 1000000000 }}",
        "{{ messages[0]['content'] * 100000000 }}",
        "{% set s = 'abcdefghij' * 100000 %}{% for i in range(1000) %}{{ s }}{% endfor %}",
        "{% set ns = namespace(s='x' * 60000) %}"
        "{% for i in range(100) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    ],
    ids=["multiply", "multiply-content", "output", "doubling"],
)
def test_a_template_building_a_huge_string_stops_at_the_output_bound(source: str) -> None:
    # A short conversation may build BASE_BUILD_CHARS (262,144), less than this output bound.
    template = ChatTemplate(source, max_output_chars=1_000_000)
    with pytest.raises(ChatTemplateLimitError, match=f"longer than {BASE_BUILD_CHARS} characters"):
        template.render(HELLO)


def test_a_template_looping_without_end_stops_at_its_time_budget() -> None:
    template = ChatTemplate(
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        render_seconds=0.05,
    )
    with pytest.raises(ChatTemplateLimitError, match="time budget"):
        template.render(HELLO)


def test_a_template_bug_is_a_chat_template_error() -> None:
    with pytest.raises(ChatTemplateError, match="TypeError"):
        ChatTemplate("{{ 'a' + 1 }}").render(HELLO)


def test_an_ordinary_template_renders_unchanged() -> None:
    template = ChatTemplate("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    assert (
        template.render([ChatTurn("user", "hi"), ChatTurn("assistant", "yo")])
        == "[user] hi\n[assistant] yo\n"
    )
