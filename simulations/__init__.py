"""Cluster simulator: predicts step time of larger clusters from measured speeds and bandwidth."""
