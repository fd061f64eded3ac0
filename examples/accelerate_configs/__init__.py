"""The shipped accelerate launch configs (installed as hf_spec_cotrain.accelerate_configs)."""
