"""Runners: turn a SchedulerOutput into tensors, run the model, sample."""
