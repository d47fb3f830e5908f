"""Extensions of a concept, each wrapping or subclassing it from outside its file: HSDP, parameter offload, the sharded 4-bit frozen base, ZeRO-Offload, zero bubble's split backward."""
