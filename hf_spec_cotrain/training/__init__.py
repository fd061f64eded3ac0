"""The pieces `SpecCoTrainGRPOTrainer` holds: the draft's co-training, the speculative rollouts and the training-step
strategies of context and pipeline parallelism."""
