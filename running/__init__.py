"""The run: its command line and checks, checkpoints and resharding, the log, the data."""
