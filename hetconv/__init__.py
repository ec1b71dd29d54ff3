"""hetconv: train CNNs with convolutions split across a heterogeneous cluster.

Arrays are float32 in NCHW layout (batch, channels, height, width) throughout.
"""

__version__ = "0.1.0"
