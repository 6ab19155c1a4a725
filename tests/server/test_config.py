"""Settings come from flags, then TOKENWIRE_* variables, then a TOML file, then defaults; bad ones
stop `tokenwire serve` at start with every problem named."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tokenwire.server import settings_sources
from tokenwire.server.cli import build_parser
from tokenwire.server.config import DEFAULT_METRICS_PORT, ModelSource, ServerSettings
from tokenwire.server.settings_sources import SETTINGS, SettingsError


def serve_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def load(*argv: str, environ: dict[str, str] | None = None) -> ServerSettings:
    return settings_sources.load(serve_args(*argv), environ or {})


def problems(*argv: str, environ: dict[str, str] | None = None) -> tuple[str, ...]:
    with pytest.raises(SettingsError) as raised:
        load(*argv, environ=environ)
    return raised.value.problems


def write_config(folder: Path, text: str) -> Path:
    path = folder / "tokenwire.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_without_any_source_every_setting_has_its_documented_default() -> None:
    settings = load()
    library = ServerSettings()
    assert settings.models == ()
    assert settings.port == library.port == 50051
    assert settings.engine.max_batch_size == library.engine.max_batch_size
    assert settings.limits == library.limits
    assert settings.keepalive == library.keepalive
    assert settings.auth == library.auth and not settings.auth.enabled
    assert settings.tls == library.tls and not settings.tls.enabled
    assert settings.health == library.health
    # The one deliberate difference: the command serves metrics, the library opens no port.
    assert settings.telemetry.metrics_port == DEFAULT_METRICS_PORT
    assert library.telemetry.metrics_port is None


def test_a_flag_beats_the_environment_which_beats_the_file_which_beats_the_default(tmp_path: Path) -> None:
    config = write_config(
        tmp_path,
        "max_batch_size = 3\nmax_queue_size = 30\ndrain_timeout = 3.5\naccess_log = false\n"
        'log_format = "json"\nhealth_queue_high_watermark = 20\n',
    )
    environ = {
        "TOKENWIRE_MAX_QUEUE_SIZE": "40",
        "TOKENWIRE_DRAIN_TIMEOUT": "4.5",
        "TOKENWIRE_ACCESS_LOG": "yes",
    }
    settings = load("--config", str(config), "--drain-timeout", "5.5", environ=environ)
    assert settings.engine.max_batch_size == 3  # file over default
    assert settings.engine.max_queue_size == 40  # environment over file
    assert settings.drain_timeout == 5.5  # flag over environment and file
    assert settings.telemetry.access_log is True  # environment over file, for a switch
    assert settings.telemetry.log_format == "json"
    assert settings.health.queue_high_watermark == 20
    assert load("--config", str(config), "--no-access-log", environ=environ).telemetry.access_log is False


def test_the_config_file_can_come_from_the_environment_and_its_paths_are_relative_to_it(
    tmp_path: Path,
) -> None:
    model = tmp_path / "models" / "tiny"
    model.mkdir(parents=True)
    (tmp_path / "tokens.txt").write_text("file-token\n", encoding="utf-8")
    config = write_config(tmp_path, 'model = ["small=models/tiny"]\nauth_tokens_file = "tokens.txt"\n')
    settings = load(environ={"TOKENWIRE_CONFIG": str(config), "TOKENWIRE_AUTH_TOKENS": "env-token"})
    assert settings.models == (ModelSource(tmp_path / "models" / "tiny", "small"),)
    assert settings.auth.tokens == ("file-token", "env-token")
    # --model given on the command line replaces the file's list entirely.
    assert load("--model", str(model), environ={"TOKENWIRE_CONFIG": str(config)}).models == (
        ModelSource(model),
    )
    assert "env-token" not in repr(settings)  # tokens never show in a repr


def test_metrics_can_be_switched_off_from_any_source(tmp_path: Path) -> None:
    assert load("--no-metrics").telemetry.metrics_port is None
    assert load(environ={"TOKENWIRE_METRICS": "false"}).telemetry.metrics_port is None
    config = write_config(tmp_path, "metrics = false\n")
    assert load("--config", str(config)).telemetry.metrics_port is None
    assert load("--config", str(config), "--metrics", "--metrics-port", "0").telemetry.metrics_port == 0


def test_every_problem_is_reported_at_once_naming_the_setting_and_where_it_came_from(tmp_path: Path) -> None:
    config = write_config(tmp_path, 'max_batch_sise = 4\nkeepalive_time = "soon"\n')
    found = problems(
        "--config",
        str(config),
        "--port",
        "70000",
        environ={"TOKENWIRE_MAX_QUEUE_SIZE": "many", "TOKENWIRE_REFLECTION": "perhaps"},
    )
    assert (
        f"--config: {config} sets 'max_batch_sise', which is not a setting (did you mean 'max_batch_size'?)"
        in found
    )
    assert f"--keepalive-time (from keepalive_time in {config}): 'soon' is not a number of seconds" in found
    assert "--max-queue-size (from TOKENWIRE_MAX_QUEUE_SIZE): 'many' is not a whole number" in found
    assert "--reflection (from TOKENWIRE_REFLECTION): 'perhaps' is not true or false" in found
    assert len(found) == 4  # parsing problems first; --port is checked once the values parse


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (("--port", "70000"), "--port: 70000 is not a TCP port"),
        (("--metrics-port", "-1"), "--metrics-port: -1 is not a TCP port"),
        (("--max-concurrent-streams", "0"), "--max-concurrent-streams: must be at least 1, got 0"),
        (("--max-receive-message-bytes", "0"), "--max-receive-message-bytes: must be at least 1, got 0"),
        (("--max-prompt-chars", "0"), "--max-prompt-chars: must be at least 1, got 0"),
        (("--max-stop-strings", "-1"), "--max-stop-strings: must be >= 0, got -1"),
        (("--keepalive-time", "0"), "--keepalive-time: must be more than 0 seconds, got 0.0"),
        (("--otlp-metrics",), "--otlp-metrics: needs --otlp-endpoint"),
        (("--log-level", "chatty"), "--log-level: 'chatty' is not DEBUG, INFO, WARNING or ERROR"),
        (("--log-format", "xml"), None),  # refused by argparse itself: a choice
        (
            ("--health-queue-high-watermark", "100"),
            "--health-queue-high-watermark: must be between 1 and --max-queue-size (64), got 100",
        ),
        (
            ("--health-queue-high-watermark", "10", "--health-queue-low-watermark", "10"),
            "--health-queue-low-watermark: must be at least 0 and below the high watermark (10), got 10",
        ),
        (
            ("--health-queue-low-watermark", "2"),
            "--health-queue-low-watermark: needs --health-queue-high-watermark",
        ),
        (
            ("--default-max-new-tokens", "9000"),
            "--default-max-new-tokens: 9000 is above --max-new-tokens-cap 4096",
        ),
        (("--metrics-port", "50051"), "--metrics-port: 50051 is also the gRPC --port"),
        (("--kv-cache-mb", "-1"), "--kv-cache-mb: must be >= 0, got -1"),
        (("--kv-cache-mb", "lots"), "--kv-cache-mb: 'lots' is not a whole number"),
        (("--kv-cache-location", "disk"), None),  # a choice: argparse refuses it
        (
            ("--kv-cache-location", "host", "--device", "cuda"),
            "--kv-cache-location: host keeps the KV cache in host memory, which a model on --device cuda "
            "would copy to the GPU and back every step; use device",
        ),
    ],
)
def test_invalid_values_are_refused_naming_the_flag(
    argv: tuple[str, ...], expected: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    if expected is None:
        with pytest.raises(SystemExit):
            serve_args(*argv)
        assert f"argument {argv[0]}: invalid choice: '{argv[1]}'" in capsys.readouterr().err
        return
    assert expected in problems(*argv)


def test_kv_cache_values_from_the_environment_and_the_file_are_refused_naming_the_flag(
    tmp_path: Path,
) -> None:
    assert problems(environ={"TOKENWIRE_KV_CACHE_LOCATION": "disk"}) == (
        "--kv-cache-location (from TOKENWIRE_KV_CACHE_LOCATION): 'disk' is not one of host, device",
    )
    assert problems(environ={"TOKENWIRE_KV_CACHE_MB": "a lot"}) == (
        "--kv-cache-mb (from TOKENWIRE_KV_CACHE_MB): 'a lot' is not a whole number",
    )
    config = write_config(tmp_path, "kv_cache_mb = -5\n")
    (problem,) = problems("--config", str(config))
    assert problem.startswith("--kv-cache-mb") and "must be >= 0, got -5" in problem


def test_the_kv_cache_settings_come_from_every_source(tmp_path: Path) -> None:
    assert ServerSettings().kv_cache.location == "device" and ServerSettings().kv_cache.limit_bytes is None
    config = write_config(tmp_path, 'kv_cache_location = "host"\nkv_cache_mb = 300\n')
    from_file = load("--config", str(config))
    assert (from_file.kv_cache.location, from_file.kv_cache.limit_bytes) == ("host", 300 * 2**20)
    from_flags = load("--kv-cache-location", "device", environ={"TOKENWIRE_KV_CACHE_MB": "64"})
    assert (from_flags.kv_cache.location, from_flags.kv_cache.mb) == ("device", 64)


def test_lora_modules_come_from_every_source_and_default_to_every_projection(tmp_path: Path) -> None:
    adapter = tmp_path / "adapter.gguf"
    adapter.write_bytes(b"")
    lora = ("--lora", f"a={adapter}")
    assert load(*lora).lora_module_names is None
    assert load(*lora, "--lora-modules", "q_proj, self_attn.v_proj,").lora_module_names == (
        "q_proj",
        "self_attn.v_proj",
    )
    assert load(*lora, environ={"TOKENWIRE_LORA_MODULES": "o_proj"}).lora_module_names == ("o_proj",)
    config = write_config(tmp_path, 'lora_modules = "gate_proj,up_proj"\n')
    assert load(*lora, "--config", str(config)).lora_module_names == ("gate_proj", "up_proj")
    assert load(*lora, "--lora-modules", "all").lora_module_names is None


def test_an_empty_or_mixed_lora_modules_list_is_refused_naming_the_flag(tmp_path: Path) -> None:
    adapter = tmp_path / "adapter.gguf"
    adapter.write_bytes(b"")
    lora = ("--lora", f"a={adapter}")
    empty = "names no module: give projections such as q_proj,v_proj, or all (every projection, the default)"
    assert problems(*lora, "--lora-modules", " , ") == (f"--lora-modules: ',' {empty}",)
    assert problems(*lora, environ={"TOKENWIRE_LORA_MODULES": ""}) == (f"--lora-modules: '' {empty}",)
    assert problems(*lora, "--lora-modules", "all,q_proj") == (
        "--lora-modules: all is every projection already: give it alone, or name projections",
    )


def test_lora_modules_without_lora_adapters_is_refused() -> None:
    # Only a model converted for --lora gets sites: the flag alone would choose nothing.
    assert problems("--lora-modules", "q_proj") == (
        "--lora-modules: needs --lora (only a model converted for --lora adapters gets LoRA sites)",
    )
    assert load("--lora-modules", "all").lora_module_names is None


def test_a_broken_config_file_is_named(tmp_path: Path) -> None:
    broken = write_config(tmp_path, "port = \n")
    assert problems("--config", str(broken))[0].startswith(f"--config: {broken} is not valid TOML")
    missing = tmp_path / "absent.toml"
    assert problems("--config", str(missing))[0].startswith(f"--config: cannot read {missing}")
    wrong_type = write_config(tmp_path, 'port = "fifty"\nmodel = 3\n')
    assert problems("--config", str(wrong_type)) == (
        f"--port (from port in {wrong_type}): 'fifty' is not a whole number",
        "--model (from model in the config file): must be a string or a list of strings",
    )


def test_help_documents_every_setting_with_its_variable_and_default() -> None:
    help_text = " ".join(build_parser()._subparsers._group_actions[0].choices["serve"].format_help().split())  # type: ignore[union-attr]
    for setting in SETTINGS:
        assert setting.flag in help_text, setting.flag
        assert setting.env in help_text, setting.env
    for mention in ("--config", "TOKENWIRE_CONFIG", "--model", "TOKENWIRE_MODEL", "TOKENWIRE_AUTH_TOKENS"):
        assert mention in help_text
    assert "--no-metrics" in help_text and "default 9464" in help_text


def test_serve_stops_at_start_with_every_problem_on_stderr(tmp_path: Path) -> None:
    config = write_config(tmp_path, "max_batch_size = 0\nunknown_thing = 1\n")
    result = subprocess.run(
        [sys.executable, "-m", "tokenwire.server.cli", "serve", "--config", str(config), "--port", "x"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "--port: 'x' is not a whole number" in result.stderr
    assert "'unknown_thing', which is not a setting" in result.stderr


@pytest.mark.parametrize("flag", ["--port", "--metrics-port"])
def test_a_port_in_use_stops_serve_with_the_flag_named(tiny_model_dir: Path, flag: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = str(taken.getsockname()[1])
        ports = {"--port": "0", "--metrics-port": "0", flag: busy}
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "tokenwire.server.cli",
                "serve",
                "--model",
                str(tiny_model_dir),
                "--host",
                "127.0.0.1",
                "--device",
                "cpu",
                *[part for pair in ports.items() for part in pair],
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 1
    assert f"{flag}: cannot listen on 127.0.0.1:{busy}" in result.stderr
    assert "Traceback" not in result.stderr
