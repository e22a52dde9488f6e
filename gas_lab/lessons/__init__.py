"""What the lessons need besides the concepts: the loops they measure,
the notebook side of lesson 00 (:mod:`~gas_lab.lessons.hello`), the capstone's rollouts,
widgets, plots, tables, and the exercises' checkers (:mod:`gas_lab.lessons.exercises`)."""
