"""Measurement: what a training step sends, holds, and computes, compared with DeepSpeed.

* :mod:`~gas_lab.measure.comm`: counting collectives (kind, calls, bytes).
* :mod:`~gas_lab.measure.memory`: bytes per rank by category, from the real tensors.
* :mod:`~gas_lab.measure.parity`: one loop on gas_lab and on DeepSpeed, and the single-process
  reference both must reach.
* :mod:`~gas_lab.measure.stages`: traffic and memory per ZeRO stage (lesson 09).
* :mod:`~gas_lab.measure.edges`: lesson 08's schedules, checkpoints, where the mean divides;
  appendix A2's bf16 gradients.
* :mod:`~gas_lab.measure.idle_rank`: a rank with nothing to train on, per ZeRO stage, on both
  libraries, and the dummy micro-batch that fixes it (lesson 07).
* :mod:`~gas_lab.measure.loss_scale`: fp16 loss scaling, gas_lab's loop against DeepSpeed's.
"""
