"""What a concept file leaves out to be read in one sitting, read after it: the sharded step's inner optimizer and checkpoints (ZeRO's and FSDP's), FSDP's wrapping, readings and step on its shards; the pipeline executor's bookkeeping, NCCL's posting order and the step's observer; the host
memory and host step that ZeRO-Offload's extensions share (offload.py)."""
