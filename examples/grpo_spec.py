"""The main job from a clone, the same as the installed command ``hf-spec-cotrain grpo`` (which launches it through
accelerate): GRPO with a co-trained draft raced against plain TRL GRPO. Its code and options are in
`hf_spec_cotrain/scripts/grpo.py`.

    accelerate launch --config_file examples/accelerate_configs/single_device.yaml examples/grpo_spec.py [options]
"""

import os

from hf_spec_cotrain.scripts.grpo import main


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
