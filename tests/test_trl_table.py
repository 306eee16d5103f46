"""Issue 40: every TRL 1.16 field is honoured or refused by name (never unknown), and docs/trl.md's table says
which, generated from common/settings/trl_fields.json and the code."""
from __future__ import annotations

import json
import re

import pytest

from common.config import GRPOConfig
from common.settings import trl_aliases, trl_table
from common.settings.knobs import from_dict


def test_no_trl_field_is_unknown():
    unknown = [f["name"] for f in trl_table.load_fields() if trl_table.classify(f)[0] == "unknown"]
    assert not unknown, f"TRL fields neither honoured nor refused by name: {unknown}"


def test_the_list_is_trl_116s():
    data = json.loads(trl_table.FIELDS_FILE.read_text())
    names = [f["name"] for f in data["fields"]]
    assert data["trl_version"] == "1.16.0" and len(names) == len(set(names))
    assert {"use_bias_correction_kl", "num_generations_eval", "log_unique_prompts", "vllm_max_model_length",
            "multi_objective_aggregation", "resume_from_checkpoint", "chat_template_kwargs"} <= set(names)


def test_docs_table_is_current():
    doc = trl_table.DOC.read_text()
    assert trl_table.section() in doc, "docs/trl.md is stale: run python -m common.settings.trl_table --write"
    counts, _ = trl_table.table()
    assert counts["unknown"] == 0 and f"**{counts['refused by name']}** refused by name" in doc


def test_a_field_the_code_stops_handling_makes_it_unknown(monkeypatch):
    """The test can fail: a refused name dropped from the code is unknown."""
    monkeypatch.delitem(trl_aliases.REFUSED, "delta")
    assert trl_table.classify({"name": "delta", "default": None})[0] == "unknown"


@pytest.mark.parametrize("field", [f for f in trl_table.load_fields()], ids=lambda f: f["name"])
def test_each_field_does_what_the_table_says(field):
    """Honoured: TRL's default loads (or is refused with a value error naming it); refused: a value other than the
    accepted ones stops the load naming the field and its reason."""
    group, _ = trl_table.classify(field)
    name = field["name"]
    if group == "refused by name":
        bad = "something else" if not isinstance(field["default"], str) else 12345
        with pytest.raises(ValueError, match=f"'{name}'.*{re.escape(trl_aliases.REFUSED[name][:20])}"):
            from_dict(GRPOConfig, {name: bad})
        for ok in trl_aliases.MATCHING.get(name, ()):
            assert from_dict(GRPOConfig, {name: ok}) == GRPOConfig()
