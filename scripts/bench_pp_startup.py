"""Per-rank memory of loading the policy under pipeline parallelism: each rank reading only its stage's tensors
(`pipeline_stage_class`, what the trainer does given the policy's name or path) against loading the whole model and
cutting it (what a rank does when handed a model already built).

What runs: a Llama of `--num_layers` layers (hidden 1024, MLP 4096, vocabulary 32768, untied, float32: 768 MiB at 8
layers), saved once; then each (mode, stages, stage) loads in a fresh process, without a process group (loading a
stage needs none), and places its parameters as the Trainer does on the rank's device (here a copy in host memory;
the Trainer places the model it is handed before the pipelined step cuts it). Per stage: the checkpoint bytes read
(`recorded_checkpoint_reads`), the peak resident set over load and placement (VmHWM, reset just before; children
run with `MALLOC_MMAP_THRESHOLD_=65536` so that freed tensors leave the resident set) minus the resident set before,
and the bytes of the parameters the stage keeps (`storage_bytes`). Printed per stage count: the largest stage's
figures, and its peak as a fraction of one process loading the whole model.

    python scripts/bench_pp_startup.py                # 2 and 4 stages: about a minute on 2 cores
"""

import argparse
import gc
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cp import _memory_status, _reset_peak  # noqa: E402

from hf_spec_cotrain.testing import save_tiny_target  # noqa: E402


MODES = ("whole", "stage")
"""whole: `from_pretrained` of the whole model, then the cut; stage: `pipeline_stage_class(...).from_pretrained`."""


def load(mode: str, stages: int, stage: int, folder: str) -> dict:
    """One stage's load in this process, then its placement (a copy of every parameter, as the Trainer's move to
    the rank's device makes): the checkpoint bytes read, the peak resident-set growth and the bytes kept."""
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_spec_cotrain.parallel.pipeline import cut_model_to_stage, pipeline_stage_class, stage_layer_ranges
    from hf_spec_cotrain.testing import recorded_checkpoint_reads, storage_bytes

    def place(model):
        with torch.no_grad():
            for param in model.parameters():
                param.data = param.data.clone()

    config = AutoConfig.from_pretrained(folder)
    gc.collect()
    before = _memory_status()["VmRSS"]
    _reset_peak()
    with recorded_checkpoint_reads() as reads:
        if mode == "stage":
            model = pipeline_stage_class(config, stage, stages).from_pretrained(folder)
            place(model)
        else:  # the Trainer places the model it is handed before the pipelined step cuts it
            model = AutoModelForCausalLM.from_pretrained(folder)
            place(model)
            layers = stage_layer_ranges(config.num_hidden_layers, stages)[stage]
            cut_model_to_stage(model, layers, is_first=stage == 0, is_last=stage == stages - 1)
            gc.collect()
    peak = _memory_status()["VmHWM"] - before
    with safe_open(Path(folder, "model.safetensors"), framework="pt") as checkpoint:
        read = sum(math.prod(checkpoint.get_slice(name).get_shape()) * 4 for name in reads)  # float32
    return {"read": read, "peak": peak, "kept": storage_bytes(model)}


def measure(mode: str, stages: int, stage: int, folder: Path) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, __file__, "--child", mode, str(stages), str(stage), str(folder)]
    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--num_layers", type=int, default=8)
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, stages, stage, folder = args.child
        print(json.dumps(load(mode, int(stages), int(stage), folder)))
        return
    mib = 2**20
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        save_tiny_target(
            folder,
            num_layers=args.num_layers,
            hidden_size=1024,
            num_attention_heads=8,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=4096,
            vocab_size=32768,
        )
        one_process = measure("whole", 1, 0, folder)
        print(f"load average {os.getloadavg()[0]:.1f}; {args.num_layers} layers, whole model in one process:")
        print(f"  read {one_process['read'] / mib:.0f} MiB, peak {one_process['peak'] / mib:.0f} MiB")
        print(f"{'stages':>6} {'mode':>6} {'read MiB':>9} {'peak MiB':>9} {'kept MiB':>9} {'peak / one process':>19}")
        for stages in args.stages:
            for mode in MODES:
                runs = [measure(mode, stages, stage, folder) for stage in range(stages)]
                read, peak, kept = (max(run[key] for run in runs) / mib for key in ("read", "peak", "kept"))
                ratio = peak * mib / one_process["peak"]
                print(f"{stages:>6} {mode:>6} {read:>9.0f} {peak:>9.0f} {kept:>9.0f} {ratio:>19.2f}")


if __name__ == "__main__":
    main()
