"""Exercises: each concept's algorithm with its body removed, and a checker that says where yours
first differs from one process.

exercises/NAME.py is a blank: the concept file's signatures, docstrings and shapes, with a TODO
where the lecture's steps go (the rest of the class comes from the concept file, which is also
the solution). Fill it in, then

    python -m exercises check NAME      # passed, or the first step that differs, and a hint
    python -m exercises list            # every exercise, what to write, what is left

The checker (exercises/checkers/NAME.py) starts its own ranks where the idea needs several
(or runs under torchrun --nproc_per_node N -m exercises check NAME). Test:
python -m pytest tests/test_exercises.py
"""

# In the lecture's order: the exercise, the concept file it is cut from.
EXERCISES = ["mixed_precision", "collectives", "ddp", "zero", "fsdp", "pipeline",
             "tensor_parallel", "context_parallel", "moe", "lora", "quantization",
             "checkpointing"]
