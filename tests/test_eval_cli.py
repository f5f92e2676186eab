"""`elasticfw eval` end to end on a model given by local path (the route users with their own
checkpoints take): a tiny random Llama saved with the default model's tokenizer."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from elasticfw.cli import main
from elasticfw.testing.models import tiny_model
from elasticfw_plugins.models.smollm2 import SmolLM2Source

pytestmark = pytest.mark.slow


def test_eval_command_on_a_local_checkpoint(tmp_path, capsys):
    tokenizer = AutoTokenizer.from_pretrained(str(SmolLM2Source().converted_dir()))
    model = tiny_model("llama", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"""
model: {{name: {tmp_path / 'tiny'}, device: cpu}}
elastic:
  retrieval_mode: {{name: full, block_size: 64}}
  sparse_mode: {{name: streaming, sink_tokens: 64, local_tokens: 64, block_size: 64}}
  executor: {{name: sdpa}}
  router: {{name: fixed, assign: all_sparse}}
eval:
  task: {{name: passkey, context_tokens: 300, num_samples: 3}}
  batch_size: 2
  max_new_tokens: 3
"""
    )
    out = tmp_path / "run"
    assert main(["eval", str(recipe), "--output", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    assert [(r["variant"], r["task"], r["index"]) for r in rows] == [("elastic", "passkey", i) for i in range(3)]
    assert all(r["msr"] == 1.0 and 0.3 < r["esr"] < 1.0 for r in rows)  # all heads streaming over ~300 tokens
    meta = json.loads((out / "sweep.json").read_text())
    assert meta["attempts"][0]["environment"]["torch"] and meta["variants"][0]["router"] == "fixed"
    assert (out / "report.html").is_file() and "elastic" in (out / "table.md").read_text()
    assert "variant 'elastic'" in capsys.readouterr().out
    # a second run into the same folder is refused; --resume has nothing left to do
    assert main(["eval", str(recipe), "--output", str(out)]) == 2
    assert "already holds a sweep" in capsys.readouterr().err
    assert main(["eval", str(recipe), "--output", str(out), "--resume"]) == 0
    # a path that is neither a registered name, an existing path nor a hub id is a recipe error
    assert main(["eval", str(recipe), "model.name=no_such_model"]) == 2
    assert "model.name" in capsys.readouterr().err
