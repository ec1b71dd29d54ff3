"""Cluster simulator: predicts the step time of larger clusters from measured speeds and links.

* :mod:`.costmodel`: one training step, call by call as the master's cluster runs it: bytes as the
  wire sends them, transfers sharing the master's link (Wi-Fi) or its switch port, per-call
  costs, each node's convolution time, and the master's other work.
* :mod:`.policies`: kernel shares: the paper's compute-only rule and a link-aware one.
* :mod:`.scenario`: scenario files (TOML) and the shipped ones in ``scenarios/``.
* :mod:`.calibrate`: devices and links from the trace of a real run.
* :mod:`.sweep`, :mod:`.plots`, :mod:`.cli`: the grid, the figures, ``hetconv simulate``.
* :mod:`.validate`: the simulator against real runs over tc-shaped links (needs root).
"""
