"""Measurement: what a training step sends, holds, and computes, compared with DeepSpeed.

* :mod:`~gas_lab.measure.comm`: counting collectives (kind, calls, bytes).
* :mod:`~gas_lab.measure.memory`: bytes per rank by category, from the real tensors (A5).
* :mod:`~gas_lab.measure.parity`: one loop on gas_lab and on DeepSpeed, and the single-process
  reference both must reach.
* :mod:`~gas_lab.measure.stages`: traffic and memory per ZeRO stage (lessons 05, 09; A5).
* :mod:`~gas_lab.measure.recording`: when each rank runs its engine calls and the collectives
  inside them; :mod:`~gas_lab.measure.chrome_trace` writes a recording as a Chrome trace.
* :mod:`~gas_lab.measure.replay`: a loop replayed on either library, and lesson 08's learning
  rate per step; :mod:`~gas_lab.measure.resume`: checkpoints resumed at a boundary or
  mid-window (08); :mod:`~gas_lab.measure.mean_division`: where the mean divides by the world
  size (05, 08); :mod:`~gas_lab.measure.bf16_gradients`: the gradient the optimizer receives
  under each precision (A2).
* :mod:`~gas_lab.measure.idle_rank`: a rank with nothing to train on, per ZeRO stage, on both
  libraries, and the dummy micro-batch that fixes it (appendix A3).
* :mod:`~gas_lab.measure.loss_scale`: fp16 loss scaling, gas_lab's loop against DeepSpeed's (A1).
* :mod:`~gas_lab.measure.matrix`: DeepSpeed's accept/refuse matrix, measured into ``data/``
  (``python -m gas_lab.measure.matrix``); :mod:`~gas_lab.measure.prediction`: what DeepSpeed
  does with a config, from the rules alone; :mod:`~gas_lab.measure.unsafe`: rules switched off,
  to measure what each one prevents (lesson 06, A4).
"""
