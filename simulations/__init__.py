"""Cluster simulator: predicts the step time of larger clusters from measured speeds and links.

The cost model of one step (:mod:`hetconv.costmodel`) and the share rules
(:mod:`hetconv.balance`) live in the core, since the master plans with them too. Here:

* :mod:`.scenario`: scenario files (TOML) and the shipped ones in ``scenarios/``.
* :mod:`.trace`: reading the trace of a real run (its plan record and step records).
* :mod:`.calibrate`: devices and links from the trace of a real run.
* :mod:`.sweep`, :mod:`.plots`, :mod:`.cli`: the grid, the figures, ``hetconv simulate``.
* :mod:`.testbed`: the master and workers in network namespaces over tc-shaped links (root).
* :mod:`.validate`: the simulator against real runs on the testbed.
"""
