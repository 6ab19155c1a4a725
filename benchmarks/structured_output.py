"""Which constrained-decoding library to build structured output on: llguidance, outlines-core and
xgrammar, side by side on this CPU with the default model's vocabulary (SmolLM2, 49,152 tokens).

For each library that is installed it measures:

- setup: building the library's view of the tokenizer, once per model;
- compile: turning each schema of a real-world set into a matcher, with the library's cache off
  (the median and the slowest schema);
- mask: one decode step's constraint work per sequence, on the path a server takes: compute the
  allowed-token bitmask, apply it to a float32 logits row of the full vocabulary, and advance the
  matcher by the chosen token; replayed along a valid document of each schema, at batch 1 and at
  batch 8 (8 sequences, each with its own matcher, using the library's batch entry point when it
  has one); mean and p99 per step;
- coverage: for each JSON Schema feature, whether the library compiles it, and whether what it
  then lets through validates: random walks that pick among the allowed tokens (leaning towards
  punctuation so documents close), checked with the `jsonschema` package.

    pip install llguidance outlines-core xgrammar jsonschema   # xgrammar brings torch
    python benchmarks/structured_output.py [--repetitions 3] [--walks 8]

Results go to benchmarks/results/structured_output.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"

Schema = dict[str, Any]

# Real-world shapes: what services ask a model to fill in.
SCHEMAS: dict[str, tuple[Schema, Any]] = {
    "person": (
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer", "minimum": 0, "maximum": 150},
                "email": {"type": "string"},
            },
            "required": ["name", "age"],
            "additionalProperties": False,
        },
        {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org"},
    ),
    "order": (
        {
            "type": "object",
            "properties": {
                "order_id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]},
                "items": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 5,
                    "items": {
                        "type": "object",
                        "properties": {
                            "sku": {"type": "string"},
                            "quantity": {"type": "integer", "minimum": 1},
                            "price": {"type": "number"},
                        },
                        "required": ["sku", "quantity", "price"],
                        "additionalProperties": False,
                    },
                },
                "shipping": {
                    "type": "object",
                    "properties": {
                        "street": {"type": "string"},
                        "city": {"type": "string"},
                        "country": {"type": "string", "minLength": 2, "maxLength": 2},
                    },
                    "required": ["city", "country"],
                    "additionalProperties": False,
                },
            },
            "required": ["order_id", "status", "items"],
            "additionalProperties": False,
        },
        {
            "order_id": "ABC-1234",
            "status": "shipped",
            "items": [
                {"sku": "pen-01", "quantity": 2, "price": 1.5},
                {"sku": "ink", "quantity": 1, "price": 4},
            ],
            "shipping": {"street": "1 Main St", "city": "Oslo", "country": "NO"},
        },
    ),
    "classification": (
        {
            "type": "object",
            "properties": {
                "label": {"enum": ["positive", "negative", "neutral"]},
                "confidence": {"type": "number", "minimum": 0, "maximum": 1},
                "reasons": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
            },
            "required": ["label", "confidence"],
            "additionalProperties": False,
        },
        {"label": "positive", "confidence": 0.92, "reasons": ["praises the food", "would return"]},
    ),
    "tool_call": (
        {
            "type": "object",
            "properties": {
                "name": {"const": "get_weather"},
                "arguments": {
                    "type": "object",
                    "properties": {
                        "location": {"type": "string"},
                        "unit": {"enum": ["celsius", "fahrenheit"]},
                        "days": {"type": "integer", "minimum": 1, "maximum": 14},
                    },
                    "required": ["location"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        },
        {"name": "get_weather", "arguments": {"location": "Paris", "unit": "celsius", "days": 3}},
    ),
    "nested_refs": (
        {
            "$defs": {
                "address": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city"],
                    "additionalProperties": False,
                }
            },
            "type": "object",
            "properties": {
                "home": {"$ref": "#/$defs/address"},
                "work": {"anyOf": [{"$ref": "#/$defs/address"}, {"type": "null"}]},
                "tags": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["home", "work"],
            "additionalProperties": False,
        },
        {"home": {"city": "Lyon", "zip": "69001"}, "work": None, "tags": ["a", "b"]},
    ),
}

# One feature each; compiled and random-walked to see whether the library enforces it.
FEATURES: dict[str, Schema] = {
    "type/required/properties": SCHEMAS["person"][0],
    "enum": {"enum": ["red", "green", "blue"]},
    "const": {"const": "fixed"},
    "array minItems/maxItems": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3},
    "string minLength/maxLength": {"type": "string", "minLength": 3, "maxLength": 5},
    "string pattern": {"type": "string", "pattern": "^[a-z]{2}[0-9]{2}$"},
    "integer minimum/maximum": {"type": "integer", "minimum": 10, "maximum": 20},
    "number exclusiveMinimum": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "anyOf": {"anyOf": [{"type": "integer"}, {"type": "boolean"}]},
    "oneOf": {"oneOf": [{"type": "string", "maxLength": 2}, {"type": "integer"}]},
    "allOf": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}]},
    "$ref/$defs": SCHEMAS["nested_refs"][0],
    "recursive $ref": {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "v": {"type": "integer"},
                    "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]},
                },
                "required": ["v", "next"],
                "additionalProperties": False,
            }
        },
        "$ref": "#/$defs/node",
    },
    "type list (nullable)": {"type": ["string", "null"], "maxLength": 4},
    "additionalProperties schema": {
        "type": "object",
        "additionalProperties": {"type": "integer"},
        "maxProperties": 3,
    },
    "format date-time": {"type": "string", "format": "date-time"},
    "format email": {"type": "string", "format": "email"},
    "format uuid": {"type": "string", "format": "uuid"},
    "prefixItems (tuple)": {
        "type": "array",
        "prefixItems": [{"type": "string"}, {"type": "integer"}],
        "items": False,
    },
    "uniqueItems": {"type": "array", "items": {"enum": [1, 2, 3]}, "uniqueItems": True, "maxItems": 3},
    "multipleOf": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100},
    "patternProperties": {
        "type": "object",
        "patternProperties": {"^x_": {"type": "integer"}},
        "additionalProperties": False,
    },
}


@dataclass
class Report:
    library: str
    setup_seconds: float = 0.0
    compile_ms: dict[str, float] = field(default_factory=dict)
    mask_us: dict[str, dict[str, float]] = field(default_factory=dict)
    coverage: dict[str, str] = field(default_factory=dict)


class Adapter:
    """One library behind the three operations a sampler needs."""

    name = ""

    def compile(self, schema: Schema) -> Any: ...
    def matcher(self, compiled: Any) -> Any: ...
    def fill(self, matchers: list[Any], bitmask: np.ndarray) -> None: ...
    def advance(self, matcher: Any, token: int) -> bool: ...
    def accepting(self, matcher: Any) -> bool: ...


def _load_vocab(model_dir: Path) -> tuple[str, list[str], list[bytes], list[int]]:
    from tokenizers import Tokenizer

    path = model_dir / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(path))
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    pieces = [tokenizer.id_to_token(i) or "" for i in range(size)]
    # Byte-level BPE: each character of a piece stands for one byte.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    to_byte = {chr(c): b for b, c in zip(printable, chars, strict=True)}
    raw = [bytes(to_byte.get(ch, 0) for ch in piece) for piece in pieces]
    config = (
        json.loads((model_dir / "genai_config.json").read_text())
        if (model_dir / "genai_config.json").exists()
        else {}
    )
    eos = config.get("model", {}).get("eos_token_id", [2])
    eos_ids = [eos] if isinstance(eos, int) else list(eos)
    return path.read_text(), pieces, raw, eos_ids


class Llguidance(Adapter):
    name = "llguidance"

    def __init__(self, tokenizer_json: str, eos: list[int]) -> None:
        import llguidance
        import llguidance.numpy

        self._llg = llguidance
        self._fill_par = llguidance.numpy.fill_next_token_bitmask_par
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, eos_token=eos)
        self._executor = llguidance.LLExecutor()

    def compile(self, schema: Schema) -> Any:
        grammar = self._llg.LLMatcher.grammar_from_json_schema(schema)
        error = self._llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ValueError(error)
        return grammar

    def matcher(self, compiled: Any) -> Any:
        matcher = self._llg.LLMatcher(self.tokenizer, compiled, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def fill(self, matchers: list[Any], bitmask: np.ndarray) -> None:
        self._fill_par(self._executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def advance(self, matcher: Any, token: int) -> bool:
        return bool(matcher.consume_token(token))

    def accepting(self, matcher: Any) -> bool:
        return bool(matcher.is_accepting())


class OutlinesCore(Adapter):
    name = "outlines-core"

    def __init__(self, raw: list[bytes], eos: list[int]) -> None:
        from outlines_core import Guide, Index, Vocabulary
        from outlines_core.json_schema import build_regex_from_schema

        self._guide, self._index, self._regex = Guide, Index, build_regex_from_schema
        tokens: dict[bytes, list[int]] = {}
        for token_id, piece in enumerate(raw):
            if token_id not in eos and piece:
                tokens.setdefault(piece, []).append(token_id)
        self.eos = eos[0]
        self.vocabulary = Vocabulary(self.eos, tokens)

    def compile(self, schema: Schema) -> Any:
        return self._index(self._regex(json.dumps(schema)), self.vocabulary)

    def matcher(self, compiled: Any) -> Any:
        return self._guide(compiled)

    def fill(self, matchers: list[Any], bitmask: np.ndarray) -> None:
        # No batch entry point: one guide after another.
        for row, guide in enumerate(matchers):
            view = bitmask[row]
            guide.write_mask_into(view.ctypes.data, view.size, view.itemsize)

    def advance(self, matcher: Any, token: int) -> bool:
        try:
            matcher.advance(token)
        except ValueError:
            return False
        return True

    def accepting(self, matcher: Any) -> bool:
        return bool(matcher.is_finished()) or self.eos in matcher.get_tokens()


class Xgrammar(Adapter):
    name = "xgrammar"

    def __init__(self, pieces: list[str], eos: list[int]) -> None:
        import torch
        import xgrammar

        self._torch, self._xgr = torch, xgrammar
        info = xgrammar.TokenizerInfo(
            pieces, xgrammar.VocabType.BYTE_LEVEL, vocab_size=len(pieces), stop_token_ids=eos
        )
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self._batch = xgrammar.BatchGrammarMatcher(max_threads=2)

    def compile(self, schema: Schema) -> Any:
        return self.compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(",", ":")
        )

    def matcher(self, compiled: Any) -> Any:
        return self._xgr.GrammarMatcher(compiled)

    def fill(self, matchers: list[Any], bitmask: np.ndarray) -> None:
        tensor = self._torch.from_numpy(bitmask)
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(tensor, 0)
        else:
            self._batch.batch_fill_next_token_bitmask(matchers, tensor)

    def advance(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))

    def accepting(self, matcher: Any) -> bool:
        return bool(matcher.is_completed())


def apply_mask(logits: np.ndarray, bitmask: np.ndarray) -> None:
    """Disallowed tokens to -inf: the one mask application all three are measured with."""
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, count=logits.shape[1], bitorder="little")
    logits += (allowed.astype(np.float32) - np.float32(1.0)) * np.float32(np.finfo(np.float32).max)


def measure_mask(adapter: Adapter, compiled: Any, tokens: list[int], batch: int, vocab: int) -> list[float]:
    """Seconds per step: fill the batch's bitmask, apply it, advance every matcher."""
    matchers = [adapter.matcher(compiled) for _ in range(batch)]
    bitmask = np.zeros((batch, (vocab + 31) // 32), dtype=np.int32)
    logits = np.random.default_rng(0).standard_normal((batch, vocab)).astype(np.float32)
    steps: list[float] = []
    for token in tokens:
        row = logits.copy()
        began = time.perf_counter()
        adapter.fill(matchers, bitmask)
        apply_mask(row, bitmask)
        for matcher in matchers:
            if not adapter.advance(matcher, token):
                raise RuntimeError(f"{adapter.name} refused a token of a valid document")
        steps.append(time.perf_counter() - began)
    return steps


def random_walk(
    adapter: Adapter, compiled: Any, raw: list[bytes], eos: set[int], rng: random.Random, vocab: int
) -> bytes | None:
    """A document the library allows, picked at random; None when it did not close in 256 tokens."""
    matcher = adapter.matcher(compiled)
    bitmask = np.zeros((1, (vocab + 31) // 32), dtype=np.int32)
    out = bytearray()
    for _ in range(256):
        adapter.fill([matcher], bitmask)
        allowed = np.flatnonzero(np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:vocab])
        if allowed.size == 0:
            return bytes(out) if adapter.accepting(matcher) else None
        stops = [t for t in allowed.tolist() if t in eos]
        if stops and rng.random() < 0.5:
            return bytes(out)
        choices = [t for t in allowed.tolist() if t not in eos]
        if not choices:
            return bytes(out)
        closing = [t for t in choices if raw[t] and raw[t][:1] in b'"]},0123456789' and len(raw[t]) <= 2]
        token = rng.choice(closing) if closing and rng.random() < 0.6 else rng.choice(choices)
        if not adapter.advance(matcher, token):
            raise RuntimeError(f"{adapter.name} refused a token it allowed")
        out += raw[token]
    return None


def coverage(adapter: Adapter, raw: list[bytes], eos: set[int], walks: int, vocab: int) -> dict[str, str]:
    import jsonschema

    found: dict[str, str] = {}
    for feature, schema in FEATURES.items():
        try:
            compiled = adapter.compile(schema)
            adapter.matcher(compiled)
        except Exception as error:
            found[feature] = f"refused: {str(error).splitlines()[0][:80]}"
            continue
        rng = random.Random(7)
        valid = invalid = unfinished = 0
        for _ in range(walks):
            document = random_walk(adapter, compiled, raw, eos, rng, vocab)
            if document is None:
                unfinished += 1
                continue
            try:
                jsonschema.validate(json.loads(document), schema)
                valid += 1
            except (ValueError, jsonschema.ValidationError):
                invalid += 1
        found[feature] = "enforced" if invalid == 0 else f"NOT enforced ({invalid}/{valid + invalid} invalid)"
        if unfinished:
            found[feature] += f", {unfinished} walks unfinished"
    return found


def run(
    adapter_factory: Callable[[], Adapter],
    model: Path,
    repetitions: int,
    walks: int,
    tokenize: Callable[[str], list[int]],
    raw: list[bytes],
    eos: list[int],
) -> Report:
    began = time.perf_counter()
    adapter = adapter_factory()
    report = Report(adapter.name, setup_seconds=time.perf_counter() - began)
    vocab = len(raw)
    for name, (schema, document) in SCHEMAS.items():
        times = []
        compiled = None
        for _ in range(repetitions):
            began = time.perf_counter()
            compiled = adapter.compile(schema)
            adapter.matcher(compiled)
            times.append(time.perf_counter() - began)
        report.compile_ms[name] = statistics.median(times) * 1000
        tokens = tokenize(json.dumps(document, separators=(",", ":")))
        for batch in (1, 8):
            steps: list[float] = []
            for _ in range(repetitions):
                steps += measure_mask(adapter, compiled, tokens, batch, vocab)
            steps.sort()
            report.mask_us.setdefault(name, {})[f"b{batch}_mean"] = statistics.fmean(steps) * 1e6
            report.mask_us[name][f"b{batch}_p99"] = steps[int(0.99 * (len(steps) - 1))] * 1e6
    report.coverage = coverage(adapter, raw, set(eos), walks, vocab)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--walks", type=int, default=8)
    parser.add_argument("--libraries", default="llguidance,outlines-core,xgrammar")
    args = parser.parse_args()

    import benchkit
    from tokenizers import Tokenizer

    model = benchkit.model_dir()
    tokenizer_json, pieces, raw, eos = _load_vocab(model)
    hf = Tokenizer.from_str(tokenizer_json)

    def tokenize(text: str) -> list[int]:
        return list(hf.encode(text, add_special_tokens=False).ids)

    factories: dict[str, Callable[[], Adapter]] = {
        "llguidance": lambda: Llguidance(tokenizer_json, eos),
        "outlines-core": lambda: OutlinesCore(raw, eos),
        "xgrammar": lambda: Xgrammar(pieces, eos),
    }
    reports = []
    for name in args.libraries.split(","):
        try:
            reports.append(run(factories[name], model, args.repetitions, args.walks, tokenize, raw, eos))
        except ImportError as error:
            print(f"{name}: not installed ({error})")
        print(f"{name}: done", flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "structured_output.json").write_text(json.dumps([r.__dict__ for r in reports], indent=2))
    markdown = render(reports, len(raw))
    (RESULTS / "structured_output.md").write_text(markdown)
    print(markdown)


def render(reports: list[Report], vocab: int) -> str:
    lines = [
        f"Vocabulary: {vocab} tokens. Times: median of repetitions; "
        "mask = fill + apply + advance per sequence-step.",
        "",
    ]
    lines.append(
        "| library | setup (s) | compile median / max (ms) | mask b1 mean / p99 (µs) "
        "| mask b8 mean / p99 (µs per step, 8 rows) |"
    )
    lines.append("| --- | --- | --- | --- | --- |")
    for r in reports:
        compile_values = list(r.compile_ms.values())
        b1 = [v["b1_mean"] for v in r.mask_us.values()]
        b1p = [v["b1_p99"] for v in r.mask_us.values()]
        b8 = [v["b8_mean"] for v in r.mask_us.values()]
        b8p = [v["b8_p99"] for v in r.mask_us.values()]
        lines.append(
            f"| {r.library} | {r.setup_seconds:.2f} "
            f"| {statistics.median(compile_values):.1f} / {max(compile_values):.1f} | "
            f"{statistics.fmean(b1):.0f} / {max(b1p):.0f} | {statistics.fmean(b8):.0f} / {max(b8p):.0f} |"
        )
    lines += ["", "Per schema (compile ms; mask b1 / b8 mean µs):", ""]
    lines.append("| schema | " + " | ".join(r.library for r in reports) + " |")
    lines.append("| --- |" + " --- |" * len(reports))
    for name in SCHEMAS:
        cells = [
            f"{r.compile_ms[name]:.1f}; {r.mask_us[name]['b1_mean']:.0f} / {r.mask_us[name]['b8_mean']:.0f}"
            for r in reports
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "JSON Schema coverage (compiled, then random walks validated with jsonschema):", ""]
    lines.append("| feature | " + " | ".join(r.library for r in reports) + " |")
    lines.append("| --- |" + " --- |" * len(reports))
    for feature in FEATURES:
        lines.append(f"| {feature} | " + " | ".join(r.coverage.get(feature, "") for r in reports) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
