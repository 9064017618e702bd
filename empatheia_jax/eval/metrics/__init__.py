"""Metrics as pure functions of predictions and references: text, speech and video."""
