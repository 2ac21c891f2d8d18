"""lm-eval's `local-completions` model against our server on a small multiple-choice task
shipped in tests/lm_eval_task: every choice's loglikelihood (completions with echo + logprobs:
prompt logprobs) equals lm-eval's own transformers model (`hf`) on the same tiny checkpoint,
and so does each answer's is-greedy flag."""
from __future__ import annotations

from pathlib import Path

import pytest

TASK = Path(__file__).parent / "lm_eval_task"


def _samples(results) -> list[list[tuple[float, bool]]]:
    rows = sorted(results["samples"]["tiny_mc"], key=lambda s: s["doc_id"])
    return [[(float(r[0][0]), bool(r[0][1])) for r in row["resps"]] for row in rows]


@pytest.mark.slow
def test_loglikelihoods_equal_transformers(server, tiny_model, tmp_path, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    (tmp_path / "tiny_mc.yaml").write_text((TASK / "tiny_mc.yaml").read_text().replace(
        "DATA_FILE", str(TASK / "tiny_mc.jsonl")))
    tasks = TaskManager(include_path=str(tmp_path))
    common = dict(tasks=["tiny_mc"], task_manager=tasks, log_samples=True, batch_size=1)
    ours = lm_eval.simple_evaluate(model="local-completions", model_args={
        "base_url": server.url + "/v1/completions", "model": server.engine.model_name,
        "tokenizer": tiny_model, "tokenizer_backend": "huggingface", "num_concurrent": 2,
        "max_retries": 1}, **common)
    reference = lm_eval.simple_evaluate(
        model="hf", model_args={"pretrained": tiny_model, "dtype": "float32",
                                "device": "cpu"}, **common)
    got, want = _samples(ours), _samples(reference)
    assert len(got) == 6 and [len(r) for r in got] == [3, 4, 3, 3, 3, 3]
    assert len({round(g, 4) for row in got for g, _ in row}) > 15  # real, distinct scores
    assert all(g < 0 for row in got for g, _ in row)
    for row_got, row_want in zip(got, want):
        assert [g for g, _ in row_got] == pytest.approx([w for w, _ in row_want], abs=1e-3)
        assert [g for _, g in row_got] == [w for _, w in row_want]
    assert ours["results"]["tiny_mc"]["acc,none"] == reference["results"]["tiny_mc"]["acc,none"]
