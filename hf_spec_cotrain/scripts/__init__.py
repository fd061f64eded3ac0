"""Jobs run from the command line (``hf-spec-cotrain <command>``), importable from the installed package: the main
job `grpo` and the pieces it is built from (its embedded task, probe, baselines, turns and report)."""
