"""Dataset loading, prompt building and the sharded prompt sampler."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from trainer.data.loading import SYSTEM_PROMPT, Example, PromptSampler, build_prompt, load_examples

# The shared read-only GSM8K copy next to the repo (never copied into it).
GSM8K_DIR = Path(__file__).resolve().parents[1].parent / "shared/data/gsm8k"
QWEN_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture
def gsm8k_dir() -> Path:
    if not (GSM8K_DIR / "train.jsonl").is_file():
        pytest.skip(f"shared GSM8K copy not found at {GSM8K_DIR}")
    return GSM8K_DIR


# ----------------------------------------------------------------------------- GSM8K
def test_gsm8k_directory(gsm8k_dir: Path) -> None:
    train = load_examples(str(gsm8k_dir), split="train", limit=5)
    assert len(train) == 5
    assert train[0].prompt.startswith("Natalia sold clips")
    assert train[0].ground_truth == "72"
    assert train[1].ground_truth == "10"
    assert "####" in train[0].meta["solution"]
    test = load_examples(str(gsm8k_dir), split="test", limit=3)
    assert len(test) == 3 and test[0].prompt != train[0].prompt


def test_gsm8k_file_and_full_ground_truths(gsm8k_dir: Path) -> None:
    test = load_examples(str(gsm8k_dir / "test.jsonl"))
    assert len(test) > 1000
    for ex in test:
        assert ex.ground_truth and "," not in ex.ground_truth and "####" not in ex.ground_truth
        assert ex.ground_truth.lstrip("-").replace(".", "", 1).isdigit(), ex.ground_truth


def test_gsm8k_ground_truth_commas_removed(tmp_path: Path) -> None:
    f = write_jsonl(tmp_path / "g.jsonl", [{"question": "q?", "answer": "steps #### 1,234 "},
                                           {"question": "q2?", "answer": "a #### b #### -5"}])
    assert [e.ground_truth for e in load_examples(str(f))] == ["1234", "-5"]


# ----------------------------------------------------------------------------- generic / parquet
def test_generic_jsonl(tmp_path: Path) -> None:
    rows = [{"prompt": "2+2?", "ground_truth": "4", "source": "toy"},
            {"prompt": "countdown", "ground_truth": {"numbers": [3, 5, 7], "target": 22}},
            {"prompt": "int truth", "ground_truth": 7}]
    f = write_jsonl(tmp_path / "train.jsonl", rows)
    exs = load_examples(str(f))
    assert exs[0] == Example("2+2?", "4", {"source": "toy"})
    assert json.loads(exs[1].ground_truth) == {"numbers": [3, 5, 7], "target": 22}
    assert exs[2].ground_truth == "7"
    assert load_examples(str(tmp_path), split="train") == exs  # directory form
    assert len(load_examples(str(f), limit=2)) == 2
    assert load_examples(str(f), limit=0) == []


def test_blank_lines_skipped(tmp_path: Path) -> None:
    f = tmp_path / "d.jsonl"
    f.write_text('{"prompt": "a", "ground_truth": "1"}\n\n  \n{"prompt": "b", "ground_truth": "2"}\n')
    assert [e.prompt for e in load_examples(str(f))] == ["a", "b"]


def test_parquet(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"question": ["How many?", "And now?"], "answer": ["x #### 72", "y #### 1,000"]}),
                   tmp_path / "test.parquet")
    exs = load_examples(str(tmp_path), split="test")
    assert [(e.prompt, e.ground_truth) for e in exs] == [("How many?", "72"), ("And now?", "1000")]
    assert load_examples(str(tmp_path / "test.parquet"), limit=1)[0].ground_truth == "72"


def test_hub_style_parquet_shard(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    (tmp_path / "main").mkdir()
    pq.write_table(pa.table({"prompt": ["p"], "ground_truth": ["g"]}), tmp_path / "main/train-00000-of-00001.parquet")
    assert load_examples(str(tmp_path))[0].ground_truth == "g"


# ----------------------------------------------------------------------------- errors
def test_bad_json_line_names_file_and_line(tmp_path: Path) -> None:
    f = tmp_path / "bad.jsonl"
    f.write_text('{"prompt": "a", "ground_truth": "1"}\n{"prompt": "b", "ground_truth": \n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: invalid JSON"):
        load_examples(str(f))


@pytest.mark.parametrize("row, msg", [
    ({"text": "hello"}, "none of the known layouts"),
    ({"question": "q", "answer": "no marker"}, "####"),
    ({"prompt": "", "ground_truth": "1"}, "non-empty"),
    ({"prompt": "p", "ground_truth": None}, "ground_truth must be"),
    ({"prompt": "p", "ground_truth": ""}, "empty ground truth"),
    ([1, 2], "JSON object"),
])
def test_bad_rows(tmp_path: Path, row, msg: str) -> None:
    f = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "ok", "ground_truth": "1"}, row])
    with pytest.raises(ValueError, match=msg) as e:
        load_examples(str(f))
    assert "rows.jsonl:2" in str(e.value)


def test_missing_sources(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_examples(str(tmp_path / "nope.jsonl"))
    with pytest.raises(FileNotFoundError, match="split 'validation'"):
        load_examples(str(tmp_path), split="validation")
    with pytest.raises(FileNotFoundError):
        load_examples("./no/such/dir")
    (tmp_path / "x.txt").write_text("a,b\n")
    with pytest.raises(ValueError, match="unsupported file type"):
        load_examples(str(tmp_path / "x.txt"))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no examples"):
        load_examples(str(tmp_path / "empty.jsonl"))
    with pytest.raises(ValueError, match="limit"):
        load_examples(str(tmp_path / "empty.jsonl"), limit=-1)


# ----------------------------------------------------------------------------- synthetic
def test_arith_source_delegates_to_trainer_arith() -> None:
    import trainer.demo.arith as arith
    assert load_examples("arith", split="test", limit=3) == arith.load_arith("test")[:3]
    assert len(load_examples("arith", split="train")) == len(arith.load_arith("train"))
    with pytest.raises(ValueError):
        load_examples("arith", split="validation")


# ----------------------------------------------------------------------------- prompts
@pytest.fixture(scope="module")
def chat_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = "<unk> <|im_start|> <|im_end|> system user assistant what is 2 + ?".split()
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<|im_end|>",
                                  additional_special_tokens=["<|im_start|>"])
    tok.chat_template = QWEN_TEMPLATE
    return tok


def test_build_prompt(chat_tokenizer) -> None:
    text = build_prompt(chat_tokenizer, "What is 2 + 2?")
    assert text.startswith("<|im_start|>system\n" + SYSTEM_PROMPT + "<|im_end|>\n")
    assert "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert "<think>" in SYSTEM_PROMPT and "<answer>" in SYSTEM_PROMPT


@pytest.mark.parametrize("system_prompt", [None, ""])
def test_build_prompt_without_system(chat_tokenizer, system_prompt) -> None:
    text = build_prompt(chat_tokenizer, "hi", system_prompt)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_build_prompt_custom_system(chat_tokenizer) -> None:
    assert build_prompt(chat_tokenizer, "hi", "Be brief.").startswith("<|im_start|>system\nBe brief.<|im_end|>")


def test_build_prompt_needs_chat_template(chat_tokenizer) -> None:
    import copy

    tok = copy.deepcopy(chat_tokenizer)
    tok.chat_template = None
    with pytest.raises(ValueError, match="chat_template"):
        build_prompt(tok, "hi")


# ----------------------------------------------------------------------------- sampler
def make_examples(n: int) -> list[Example]:
    return [Example(prompt=f"q{i}", ground_truth=str(i)) for i in range(n)]


def test_sampler_deterministic() -> None:
    exs = make_examples(37)
    a = [e.prompt for e in PromptSampler(exs, seed=3).next_batch(100)]
    b = [e.prompt for e in PromptSampler(exs, seed=3).next_batch(100)]
    c = [e.prompt for e in PromptSampler(exs, seed=4).next_batch(100)]
    assert a == b and a != c


def test_sampler_epochs_cover_everything_once() -> None:
    exs = make_examples(20)
    s = PromptSampler(exs, seed=0)
    e0, e1 = s.next_batch(20), s.next_batch(20)
    assert sorted(e.prompt for e in e0) == sorted(e.prompt for e in exs)
    assert sorted(e.prompt for e in e1) == sorted(e.prompt for e in exs)
    assert [e.prompt for e in e0] != [e.prompt for e in e1]  # reshuffled each epoch
    assert s.epoch == 1


def test_sampler_batches_cross_epoch_boundaries() -> None:
    exs = make_examples(7)
    whole = [e.prompt for e in PromptSampler(exs, seed=1).next_batch(30)]
    s = PromptSampler(exs, seed=1)
    pieces = [e.prompt for n in (3, 5, 0, 11, 11) for e in s.next_batch(n)]
    assert pieces == whole
    it = PromptSampler(exs, seed=1)
    assert [next(it).prompt for _ in range(30)] == whole


@pytest.mark.parametrize("n, shards", [(40, 4), (41, 3), (5, 2), (100, 8)])
def test_shards_disjoint_within_epoch(n: int, shards: int) -> None:
    exs = make_examples(n)
    samplers = [PromptSampler(exs, seed=9, shard=r, num_shards=shards) for r in range(shards)]
    for epoch in range(3):
        per = [set(s.epoch_indices(epoch)) for s in samplers]
        assert sum(len(p) for p in per) == n  # together they cover the epoch...
        assert set().union(*per) == set(range(n))  # ...exactly once
    # and the streams the ranks actually draw in epoch 0 do not overlap
    drawn = [{e.prompt for e in s.next_batch(len(s.epoch_indices(0)))} for s in samplers]
    for i in range(shards):
        for j in range(i + 1, shards):
            assert not drawn[i] & drawn[j]


def test_sampler_fewer_examples_than_shards() -> None:
    exs = make_examples(2)
    for r in range(4):
        batch = PromptSampler(exs, seed=0, shard=r, num_shards=4).next_batch(5)
        assert len(batch) == 5


def test_sampler_validation() -> None:
    with pytest.raises(ValueError):
        PromptSampler([], seed=0)
    with pytest.raises(ValueError):
        PromptSampler(make_examples(3), seed=0, shard=2, num_shards=2)
    with pytest.raises(ValueError):
        PromptSampler(make_examples(3), seed=0).next_batch(-1)


def test_sampler_random_sizes_seeded() -> None:
    rng = random.Random(0)
    for _ in range(20):
        n, shards = rng.randint(1, 50), rng.randint(1, 6)
        exs = make_examples(n)
        for r in range(shards):
            s = PromptSampler(exs, seed=rng.randint(0, 99), shard=r, num_shards=shards)
            k = rng.randint(0, 120)
            assert len(s.next_batch(k)) == k
            assert all(0 <= i < n for i in s.epoch_indices(0))
