"""The command-line applications on top of the library: ``fpdt-train`` (:mod:`fpdt.cli.train`).

They sit above every package (the trainer's command line checks its run with the planner,
:mod:`fpdt.plan.trainer_run`); nothing in ``fpdt`` imports them.
"""
