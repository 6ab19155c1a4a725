"""Model directories whose chat template was written by an attacker.

TRAPDOOR renders the tiny model's ChatML for every conversation but the ones that spring it: a
message whose content names one of the review's attacks runs that attack first. Such a template
passes any check at load on ordinary conversations and costs only the callers that spring it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tokenwire.server.model_tools.tiny_tokenizer import CHATML_TEMPLATE

ATTACKS = {
    "format": "{{ ('%0' ~ (messages | length * 300000000) ~ 'd') | format(1) }}",
    "power": "{% set n = messages | length %}{{ (n + 8) ** (n * 6000000) }}",
    "doubling": (
        "{% set ns = namespace(s='x' * 60000) %}"
        "{% for i in range(100) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}"
    ),
    "tower": "{{ (messages | length + 8) ** ((messages | length + 8) ** (messages | length + 8)) }}",
}
"""The review's attacks, each made of the input so that nothing is constant at compile time."""

TRAPDOOR = (
    "{% for message in messages %}"
    + "".join(
        f"{{% if message['content'] == {name!r} %}}{attack}{{% endif %}}" for name, attack in ATTACKS.items()
    )
    + "{% endfor %}"
    + CHATML_TEMPLATE
)


def with_template(model_dir: Path, target: Path, template: str) -> Path:
    """A copy of `model_dir` whose tokenizer_config.json carries `template`."""
    shutil.copytree(model_dir, target)
    config_path = target / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = template
    config_path.write_text(json.dumps(config))
    return target
