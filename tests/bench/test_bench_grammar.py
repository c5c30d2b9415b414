"""`verispec bench --json-schema`: every run measured without and with the grammar, on a random shape
(which gets a byte vocabulary of its size) and on a checkpoint; a bad schema file fails up front."""
from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from verispec.bench.build import random_target
from verispec.bench.options import BUILTIN_SCHEMA
from verispec.bench.shapes import get_shape
from verispec.bench.vocabulary import ByteVocabularyTokenizer
from verispec.cli import main
from verispec.config import EngineConfig
from verispec.engine.engine import Engine
from verispec.sampling.params import SamplingParams
from verispec.grammar.spec import json_schema_grammar


def test_shape_rows_with_and_without_the_grammar(tmp_path, capsys):
    rc = main(["bench", "--shape", "tiny", "--device", "cpu", "--methods", "ar,eagle3", "--contexts", "16",
               "--gen-tokens", "12", "--repeats", "1", "--step-iters", "2", "--json-schema", "builtin",
               "--concurrency", "1,2", "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    report = json.loads((tmp_path / "bench.json").read_text())
    rows = {(r["method"], r["concurrency"]): r for r in report["rows"]}
    assert set(rows) == {(m, n) for m in ("ar", "ar+json", "eagle3", "eagle3+json") for n in (1, 2)}
    for (method, _), row in rows.items():
        assert row["decode_tok_s"] > 0
        assert (row.get("vs_unconstrained") is not None) == method.endswith("+json")
    assert report["meta"]["json_schema"] == "builtin"
    assert "vs no grammar" in (tmp_path / "bench.md").read_text()


def test_byte_vocabulary_decodes_constrained_output_to_valid_json():
    """What the shape bench generates under the builtin schema is that schema's JSON (a prefix of it,
    cut by max_tokens): the stand-in vocabulary's bytes are what the grammar saw."""
    shape = get_shape("tiny")
    target = random_target(shape.name, shape.config, torch.device("cpu"), torch.float32, seed=0)
    tokenizer = ByteVocabularyTokenizer(target.model.vocab_size)
    engine = Engine(target.model, tokenizer, EngineConfig(model="tiny", max_model_len=256))
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "b": {"enum": ["x", "yz"]}}, "required": ["a", "b"],
              "additionalProperties": False}
    result = engine.generate_all([1, 2, 3], SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True,
                                                           grammar=json_schema_grammar(schema)))
    assert result.finish_reason.value == "stop"
    jsonschema.validate(json.loads(tokenizer.decode(result.token_ids)), schema)
    assert json_schema_grammar(BUILTIN_SCHEMA)  # the builtin schema is one llguidance takes


@pytest.mark.parametrize("content,message", [("{not json", "is not JSON"), ("[1, 2]", "schema object")])
def test_bad_schema_file_fails_first(tmp_path, capsys, content, message):
    path = tmp_path / "schema.json"
    path.write_text(content)
    assert main(["bench", "--shape", "tiny", "--device", "cpu", "--json-schema", str(path)]) != 0
    err = capsys.readouterr().err
    assert "--json-schema" in err and message in err
