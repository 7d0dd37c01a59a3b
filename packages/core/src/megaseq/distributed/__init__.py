"""Distributed training: process layout, process groups, sharded state, launch.

- ``layout``: ``dp x cp`` workers, ``ep`` cut from them; the checks a layout must pass before anything starts.
- ``groups``: ``Parallel``, this process's place and groups (from megatron-core's ``parallel_state``) and
  the collectives the trainer uses; ``Parallel()`` is the single process.
- ``experts``: which tensors expert parallelism splits, same initial weights under every layout.
- ``sharded``: what each rank writes into a checkpoint and how any layout reads it back.
- ``launch``: workers started by Ray Train (locally or on a cluster) or by torchrun.

megatron-core and Ray are the optional extra ``megaseq-core[distributed]``; nothing here imports them
until a layout with more than one worker is run.
"""
