"""scripts/gpu_check.py on CPU: arguments, stage bookkeeping (budgets, stop at the first failure), the JSON and
Markdown report, and a dry run of the real stages on tiny CPU shapes (the vLLM stages are skipped there)."""

import json
import sys
import time
from pathlib import Path

import pytest
import torch


sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import gpu_check  # noqa: E402


def _stages(calls: list[str]) -> list[gpu_check.Stage]:
    def ok(name):
        return lambda ctx: calls.append(name) or {"summary": f"{name} | fine", "value": 1}

    def broken(ctx):
        calls.append("broken")
        raise AssertionError("3/8 rows differ")

    return [
        gpu_check.Stage("environment", 5, ok("environment")),
        gpu_check.Stage("kernels", 5, ok("kernels")),
        gpu_check.Stage("hf_generate", 5, broken),
        gpu_check.Stage("server", 5, ok("server"), needs_vllm=True),
    ]


def _context(tmp_path):
    return gpu_check.Context(device=torch.device("cpu"), dry_run=True, work_dir=tmp_path)


def test_the_check_stops_at_the_first_failure_and_reports_every_stage(tmp_path):
    calls = []
    status = gpu_check.main(["--cpu_dry_run", "--with_vllm", "--out_dir", str(tmp_path)], stages=_stages(calls))
    assert status == 1 and calls == ["environment", "kernels", "broken"]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["meta"]["verdict"] == "FAILED at hf_generate" and report["meta"]["mode"] == "CPU dry run"
    stages = {stage["name"]: stage for stage in report["stages"]}
    assert [stage["status"] for stage in report["stages"]] == ["passed", "passed", "failed", "skipped"]
    assert stages["kernels"]["details"] == {"value": 1} and stages["kernels"]["summary"] == "kernels | fine"
    assert stages["hf_generate"]["error"] == "AssertionError: 3/8 rows differ"
    assert "raise AssertionError" in stages["hf_generate"]["details"]["traceback"]
    assert stages["server"]["summary"] == "not run: stage 'hf_generate' failed"
    table = (tmp_path / "gpu_check.md").read_text()
    assert "**FAILED at hf_generate**" in table
    assert "| kernels | passed |" in table and "kernels \\| fine" in table  # a pipe in a cell is escaped
    assert "| hf_generate | failed |" in table and "AssertionError: 3/8 rows differ" in table


def test_skipped_stages_and_vllm_stages_in_the_dry_run(tmp_path):
    calls = []
    stages = [stage for stage in _stages(calls) if stage.name != "hf_generate"]
    reports = []
    results = gpu_check.run_stages(
        stages, _context(tmp_path), skip={"kernels"}, total_budget=60, vllm=False, report=reports.append
    )
    assert calls == ["environment"]
    assert [(r.name, r.status) for r in results] == [
        ("environment", "passed"),
        ("kernels", "skipped"),
        ("server", "skipped"),
    ]
    assert "--with_vllm" in results[2].summary
    assert len(reports) == 1  # after each stage that ran


def test_a_stage_over_its_budget_fails_and_a_spent_total_skips_the_rest(tmp_path):
    def spin(ctx):
        while True:
            time.sleep(0.01)

    stages = [gpu_check.Stage("kernels", 0.2, spin), gpu_check.Stage("server", 5, lambda ctx: {})]
    results = gpu_check.run_stages(stages, _context(tmp_path), skip=set(), total_budget=60, vllm=True)
    assert results[0].status == "failed" and results[0].error == "StageTimeout: over its budget of 0 s"
    assert results[1].status == "skipped"
    results = gpu_check.run_stages(stages[1:], _context(tmp_path), skip=set(), total_budget=0, vllm=True)
    assert results[0].summary == "not run: the total budget is spent"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--skip", "kernels,warp_drive"], "unknown stage"),
        (["--with_vllm"], "--with_vllm is for --cpu_dry_run"),
        (["--total_budget", "ten"], "invalid float value"),
    ],
)
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        gpu_check.main(argv, stages=[])
    assert message in capsys.readouterr().err


def test_the_report_goes_to_OUT_by_default(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert gpu_check.main(["--cpu_dry_run", "--skip", "environment"], stages=_stages([])[:1]) == 0
    assert json.loads((tmp_path / "gpu_check.json").read_text())["meta"]["verdict"] == "passed"


def test_cpu_dry_run_of_the_real_stages(tmp_path):
    """Every stage's logic on tiny CPU shapes (PyTorch's CPU flash kernel stands in for the fused CUDA kernels)."""
    assert gpu_check.main(["--cpu_dry_run", "--out_dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    statuses = {stage["name"]: stage["status"] for stage in report["stages"]}
    assert statuses == {
        **dict.fromkeys(
            [
                "environment",
                "kernels",
                "hf_generate",
                "generation_timings",
                "dflash_kernels",
                "dflash_generate",
                "dflash_timings",
                "cotrain_overhead",
            ],
            "passed",
        ),
        "cotrain_vllm": "skipped",
        "server": "skipped",
    }
    stages = {stage["name"]: stage["details"] for stage in report["stages"]}
    assert {key.rsplit(" / ", 1)[-1] for key in stages["kernels"]["runs"]} == {"auto", "sdpa_flash"}
    assert stages["hf_generate"]["float32"]["equal_rows"] == "8/8"
    assert sorted(stages["generation_timings"]["batches"]) == ["1", "2", "4"]
