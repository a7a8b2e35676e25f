"""Tensor parallel inside the GPU daemon (device_topology.gpu.tensor_parallel): one rank per
device, rank 0 the engine, the others worker processes that run the same forward on their
shard of the weights. sharding.py says how the weights split, model.py is the sharded model
and its collectives, step.py carries each step from rank 0 to the workers, launch.py starts
them and worker.py is their loop."""
