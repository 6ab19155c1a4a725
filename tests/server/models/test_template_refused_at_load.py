"""A model whose chat template runs past its budget on an ordinary conversation is refused when
it loads, naming the file, instead of stalling the server before it ever serves: `tokenwire
serve` exits with the one reason. Constant expressions are not folded when the template is
compiled, so even `{{ 9 ** (9 ** 9) }}` costs nothing until it is rendered, and then is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.serve_process import serve_refused
from tests.support.templates import with_template

TEMPLATES = {
    "tower of powers": ("{{ 9 ** (9 ** 9) }}", "more than 10000 bits"),
    "printf width": ("{{ '%0300000000d' | format(1) }}", "longer than 262144 characters"),
    "spinning": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "time budget",
    ),
}


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_serve_refuses_a_template_over_budget_naming_its_file(
    name: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    template, reason = TEMPLATES[name]
    model = with_template(tiny_model_dir, tmp_path / "tiny", template)
    result = serve_refused(model)
    assert result.returncode != 0
    failures = [line for line in result.stderr.splitlines() if "failed to load" in line]
    assert len(failures) == 1, result.stderr[-2000:]
    assert f"{model / 'tokenizer_config.json'}: chat_template: " in failures[0]
    assert reason in failures[0]
