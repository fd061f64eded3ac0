"""Run by tests/distributed/test_trainer_pp_vllm.py under `torchrun --nproc_per_node 2`: the two GRPO steps of
`pp_cotrain_script.py` on 2 pipeline stages, with speculative rollouts from the package's vLLM server
(`vllm_mode="server"`, its address in the `SERVER_URL_ENV` variable, its key in ``HF_SPEC_COTRAIN_API_KEY``).

Step 0's push goes through; step 1's fails on purpose: the last stage sends `lm_head.weight` with a NaN (a copy: the
policy itself is untouched), after stage 0's chunks are staged, so the server refuses the whole transaction at its
commit and that step falls back to plain rollouts through the stages. After training every stage pushes its final
weights once more, so that the test can read them back from the server's rollouts.

Besides `pp_cotrain_script`'s record, each rank records every push it took part in (`sync_stages`: the step, the
weight set, this stage's tensors, the version committed or the error), and the last stage every rollout request to
the server (the step, the weights versions that served it, the completions, the drafts it made). The mode "pp-dflash"
co-trains `pp_cotrain_script`'s DFlash draft, which the server must speculate with.
"""

import math
import os
from pathlib import Path

from cotrain_cases import equality_trainer, main, record_training
from pp_cotrain_script import VARIANTS, FixedRolloutTrainer, rows_in_one_order, run_config

from hf_spec_cotrain.generation import stage_sync


SERVER_URL_ENV = "PP_VLLM_SERVER_URL"
FAILING_STEP = 1
POISONED = "lm_head.weight"


def record_pushes(trainer) -> list[dict]:
    """Every `sync_stages` call of this rank (filled in as the trainer pushes); poisons step `FAILING_STEP`'s policy
    push on the last stage."""
    pushes = []
    sync_stages = stage_sync.sync_stages
    last_stage = trainer.accelerator.process_index == trainer.accelerator.num_processes - 1

    def recording(client, which, named_tensors, **kwargs):
        step = trainer.state.global_step
        tensors = [(name, tensor.detach().clone()) for name, tensor in named_tensors]
        sent = tensors
        if step == FAILING_STEP and which == "policy" and last_stage:
            poisoned = dict(tensors)[POISONED].clone()
            poisoned.view(-1)[0] = math.nan
            sent = [(name, poisoned if name == POISONED else tensor) for name, tensor in tensors]
        entry = {"step": step, "which": which, "tensors": dict(tensors)}
        pushes.append(entry)
        try:
            entry["version"] = sync_stages(client, which, sent, **kwargs).version
        except Exception as error:
            entry["error"] = f"{type(error).__name__}: {error}"
            raise

    stage_sync.sync_stages = recording
    return pushes


def record_server_rollouts(trainer) -> list[dict]:
    """Every rollout request this rank sends to the server."""
    served = []
    client = trainer.rollout_engine
    generate = client.generate

    def recording(*args, **kwargs):
        out = generate(*args, **kwargs)
        versions = (out.versions.policy, out.versions.draft)
        served.append(
            {
                "step": trainer.state.global_step,
                "versions": versions,
                "completions": out.completion_ids,
                "num_drafts": out.spec_decode.num_drafts,
            }
        )
        return out

    client.generate = recording
    return served


def run(policy_dir: str, out_dir: str, mode: str) -> dict:
    """``mode``: "pp", or "pp-dflash" for `pp_cotrain_script`'s DFlash draft."""
    mode, _, variant = mode.partition("-")
    assert mode == "pp" and variant in ("", "dflash"), mode
    server = dict(use_vllm=True, vllm_mode="server", vllm_server_base_url=os.environ[SERVER_URL_ENV])
    config = run_config(out_dir, 2, **server, **VARIANTS.get(variant, {}))
    trainer = equality_trainer(FixedRolloutTrainer, policy_dir, config)
    pushes, served = record_pushes(trainer), record_server_rollouts(trainer)

    def after_training():
        trainer.save_model(str(Path(out_dir, "final")))
        trainer.rollouts.backend.prepare(trainer.state.global_step)  # the final weights, read back by the test
        if trainer.accelerator.process_index == trainer.parallel.last_rank:
            trainer.save_draft(Path(out_dir, "final_draft"))

    with rows_in_one_order(config):
        record = record_training(trainer, after_training=after_training)
    return {**record, "generated": trainer.generated, "pushes": pushes, "served": served}


if __name__ == "__main__":
    main(run)
