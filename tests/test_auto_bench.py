"""storch-bench --estimator auto: the run folder holds Auto's record (auto.json), and a run resumes."""

from __future__ import annotations

import json
import math

import pytest

from storch.bench import train
from storch.bench.data import load_dataset

QUICK = {"steps": 8, "eval_every": 4, "eval_size": 40, "eval_k": 8, "eval_elbo_k": 2, "var_every": 4,
         "var_reps": 3, "batch_size": 20, "latent_dim": 12, "estimator": "auto"}


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


@pytest.mark.parametrize("cfg", [
    {"budget": 4},
    {"model": "sbn-two-layer", "budget": 2},
    {"model": "categorical-vae", "budget": 3, "latent_dim": 3, "categories": 4},
])
def test_auto_writes_its_record_into_the_run_folder(tmp_path, digits, cfg):
    summary = train.run({**QUICK, **cfg}, tmp_path / "run", progress=False, data=digits, log=lambda *_: None)
    assert math.isfinite(summary["test_nll"])
    records = json.loads((tmp_path / "run" / "auto.json").read_text())
    model_latents = {"sbn-two-layer": ["z1", "z2"]}.get(cfg.get("model"), None)
    assert list(records) == (model_latents or list(records)) and records
    if model_latents:  # the lower layer's Auto gets 2 evaluations per upper sample, the top the rest
        assert (records["z1"]["budget"], records["z2"]["budget"]) == (1, 2)
    for record in records.values():
        assert record["step"] == QUICK["steps"] and record["choice"] in [r["candidate"] for r in record["candidates"]]
        assert record["switches"][0]["to"] == "(measuring)"
        assert all(r["unbiased"] for r in record["candidates"])
        assert all(r["evaluations"] <= record["budget"] for r in record["candidates"])
        assert all(r["cost_unit"] == "CPU seconds" for r in record["candidates"])  # on the CPU: CPU time
        spans = train.auto_timeline(record, QUICK["steps"])  # what plots.png draws of its choices
        assert spans[0][0] == 0 and spans[-1][1] == QUICK["steps"]
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        assert {what for *_, what in spans} <= {"(measuring)"} | {r["candidate"] for r in record["candidates"]}
    assert (tmp_path / "run" / "plots.png").is_file()


def test_an_auto_run_resumes_from_its_checkpoint(tmp_path, digits):
    cfg = {**QUICK, "budget": 2, "checkpoint_every": 4}
    train.run({**cfg, "steps": 4}, tmp_path / "part", progress=False, data=digits, log=lambda *_: None)
    train.resume(tmp_path / "part", steps=8, progress=False, log=lambda *_: None)
    record = json.loads((tmp_path / "part" / "auto.json").read_text())["z"]
    assert record["step"] == 8 and sum(r["steps"] for r in record["candidates"]) == 8
