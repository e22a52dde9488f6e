"""The notebook runtime: persistent rank processes a notebook starts once (lesson 00).

* :mod:`~gas_lab.runtime.cluster`: :func:`start_cluster`, ``cluster.run(fn)``, ``%%ranks``.
* :mod:`~gas_lab.runtime.on_rank`: what runs inside each rank process.
* :mod:`~gas_lab.runtime.launch`: the controller and the ranks' parent started; a restart
  forks only the ranks anew (:mod:`~gas_lab.runtime.rank_process`: that parent).
* :mod:`~gas_lab.runtime.calls`: one call on the ranks: bounded waits, interrupts, the outcome.
* :mod:`~gas_lab.runtime.rank_errors`: the errors a failed, stalled or interrupted call raises.
* :mod:`~gas_lab.runtime.rank_state`, :mod:`~gas_lab.runtime.watch`: what an unfinished rank is
  doing (in a collective, or busy); ``cluster.watch``: which rank died and how.
* :mod:`~gas_lab.runtime.streaming`, :mod:`~gas_lab.runtime.values`: rank output in the cell
  while the ranks run; each rank's value of a ``%%ranks`` cell, shown like ``Out``.
* :mod:`~gas_lab.runtime.status`: ``cluster.status()``, ``%ranks_status``: what each rank is.
* :mod:`~gas_lab.runtime.notices`: what the runtime did, told apart from its errors.
* :mod:`~gas_lab.runtime.fresh`: fresh ranks for one run, forked in a fraction of a second.
* :mod:`~gas_lab.runtime.lifetime`: every process ends with the kernel; ``run_command``.
* :mod:`~gas_lab.runtime.build_lock`: stale C++ build locks that make DeepSpeed wait forever.
* :mod:`~gas_lab.runtime.ops`: DeepSpeed's C++ ops built once per environment (``make ops``).
* :mod:`~gas_lab.runtime.arguments`, :mod:`~gas_lab.runtime.magic`,
  :mod:`~gas_lab.runtime.sending`: argument checks, ``%%ranks``, what travels with a function.
"""
