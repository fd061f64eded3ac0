"""The command line of a tiny run of the main job (`hf_spec_cotrain.scripts.grpo`), for the tests that run it end to
end: a few supervised and warm-start steps, two GRPO steps of 4 samples, everything under ``tmp_path``."""


def tiny_job_args(tmp_path, *, max_completion_length: int = 16, probe_prompts: int = 4) -> list[str]:
    options = {
        "output_dir": tmp_path / "run",
        "cache_dir": tmp_path / "cache",
        "sft_steps": 4,
        "warm_start_steps": 3,
        "warm_start_samples": 32,
        "max_steps": 2,
        "max_completion_length": max_completion_length,
        "probe_prompts": probe_prompts,
        "per_device_train_batch_size": 4,
        "num_generations": 4,
    }
    return [arg for name, value in options.items() for arg in (f"--{name}", str(value))]
