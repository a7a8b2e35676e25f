"""What every process needs to run: logging, CPU affinity, systemd notification, start-up errors
and heartbeat percentiles.
"""
