"""Training: the objectives, optimizer and schedules, the jitted step, sharding, Orbax checkpoints and the loop."""
