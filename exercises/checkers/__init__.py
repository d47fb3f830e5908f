"""The checkers: one per exercise, each a list of steps against one process
(exercises/grading.py)."""
