"""Training, evaluation and the demo around the LSS model: a short run_step plus hooks for logging,
eval, checkpoints and pictures."""
