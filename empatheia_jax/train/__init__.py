"""Training: run-config validation, losses, stages, the orbax train checkpoints and the jitted, sharded
loop."""
