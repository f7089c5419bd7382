"""Chapter 10: training across processes on torch.distributed. A memory model of training
(`memory`), a counter of the bytes each collective moves (`comm`), data parallelism with bucketed
all-reduce hooks (`ddp`), ZeRO stages 1 to 3 (`zero`), Megatron tensor parallelism (`tensor`),
pipeline parallelism with GPipe and 1F1B (`pipeline`) and activation checkpointing (`checkpointing`).
"""
