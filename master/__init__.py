"""The coordinator: the cluster (a ConvExecutor over the workers) and its rooms: membership,
probing, planning, each layer's way of running, dispatch, the worker client."""
