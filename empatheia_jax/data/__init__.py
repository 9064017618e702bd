"""Data path: the AvaMERG record schema, prompt templates, shards, generator-target files, media encoders and
the grain input pipeline."""
