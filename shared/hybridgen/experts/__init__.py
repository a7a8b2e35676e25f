"""MoE experts in host memory (Cold-Weights): their formats, the shared arena, the device cache's
store, the latency model and the CPU daemon's link.
"""
