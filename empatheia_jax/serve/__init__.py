"""Serving: loading a trained run or export, batched generation and one chat turn."""
