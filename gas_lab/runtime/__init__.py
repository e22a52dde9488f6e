"""The notebook runtime: persistent rank processes a notebook starts once (lesson 00).

* :mod:`~gas_lab.runtime.cluster`: :func:`start_cluster`, ``cluster.run(fn)``, ``%%ranks``.
* :mod:`~gas_lab.runtime.on_rank`: what runs inside each rank process.
* :mod:`~gas_lab.runtime.rank_errors`: the errors a failed or stalled rank raises here.
"""
