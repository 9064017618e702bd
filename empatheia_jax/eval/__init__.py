"""Evaluation: metrics as pure functions, eval orchestration, reports, baselines and ablation tables."""
