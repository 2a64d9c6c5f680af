"""Tensor parallelism: one engine's model split over a group of ranks (processes), each holding
a shard of every layer (attention heads and their KV heads, MLP columns, experts, the vocab),
joined by all-reduces. `group.py` is the communicator (torch.distributed: gloo on CPU, NCCL on
GPU; or a single rank), `shard.py` says which part of each weight a rank holds, and
`follower.py` is what a rank other than 0 runs: the same forward passes, driven by rank 0's
steps."""
