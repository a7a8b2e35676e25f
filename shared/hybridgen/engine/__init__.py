"""The model engine (what the GPU daemon runs): requests, scheduling, the KV block pool, the model
runner, CUDA graphs, the memory plan and step outputs.
"""
