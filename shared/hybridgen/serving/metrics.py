"""The gateway's Prometheus metrics, in a registry of their own.

A dedicated CollectorRegistry (not prometheus_client's global one) lets one process, such as a
test, build several servers without duplicate-metric errors. The backend sets the gauges it
knows about (KV usage, ring occupancy, heartbeat jitter, GPU memory); the service records the
rest.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

# Latency buckets in seconds: sub-millisecond decode steps up to slow CPU prefills.
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class Metrics:
    """Every metric the gateway exports; one instance per server."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft = Histogram(
            "hybridgen_time_to_first_token_seconds",
            "From the request's arrival to its first generated token.",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "hybridgen_inter_token_latency_seconds",
            "Time between consecutive generated tokens of one request (a message carrying n "
            "tokens counts n times, its gap divided by n).",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge(
            "hybridgen_queue_depth",
            "Requests accepted but not yet streaming (the admission queue).",
            registry=r,
        )
        self.requests = Counter(
            "hybridgen_requests",
            "Finished Generate calls by finish reason (stop, length, stop_sequence, "
            "cancelled, error, time_limit: server.request_timeout_s ended it).",
            ["finish_reason"],
            registry=r,
        )
        self.rejected = Counter(
            "hybridgen_requests_rejected",
            "Calls that ended with an error status (refused, or failed mid-stream), by code.",
            ["code"],
            registry=r,
        )
        self.kv_usage = Gauge(
            "hybridgen_kv_cache_usage_ratio",
            "Fraction of the Hot-KV pool's blocks in use, by tier (set by the backend).",
            ["tier"],
            registry=r,
        )
        self.ring_occupancy = Gauge(
            "hybridgen_ring_occupancy_ratio",
            "Fraction of a shared-memory ring's slots in use (set by the backend).",
            ["ring"],
            registry=r,
        )
        self.heartbeat_jitter = Gauge(
            "hybridgen_heartbeat_jitter_p99_seconds",
            "p99 lateness of a daemon's scheduler heartbeat (set by the backend).",
            ["daemon"],
            registry=r,
        )
        self.running = Gauge(
            "hybridgen_running_requests",
            "Requests the engine is running (set by the backend).",
            registry=r,
        )
        self.hot_hit = Gauge(
            "hybridgen_kv_hot_hit_ratio",
            "Hot Hit Rate: share of the keys decode steps attended that were in GPU memory.",
            registry=r,
        )
        self.warm_decompress = Gauge(
            "hybridgen_warm_decompress_latency_seconds",
            "Warm Decompress Latency over recent (layer, step) calls, by quantile.",
            ["quantile"],
            registry=r,
        )
        self.cpu_attention = Gauge(
            "hybridgen_cpu_attention_seconds",
            "CPU time spent on attention over Warm-KV blocks since start.",
            registry=r,
        )
        self.pcie_bytes = Gauge(
            "hybridgen_kv_transfer_bytes",
            "Compressed Warm-KV bytes moved since start: h2d to the device, d2h into Warm.",
            ["direction"],
            registry=r,
        )
        self.warm_drafts = Gauge(
            "hybridgen_warm_draft_tokens",
            "Self-speculative decoding over Warm since start: tokens drafted attending Hot "
            "alone, and drafts the check over Hot and Warm accepted.",
            ["outcome"],
            registry=r,
        )
        self.prefix_cached = Gauge(
            "hybridgen_prefix_cached_tokens",
            "Prompt tokens served from the prefix cache since start.",
            registry=r,
        )
        self.prefix_hits = Gauge(
            "hybridgen_prefix_hits",
            "Requests whose first admission took cached prefix blocks from a tier, since start.",
            ["tier"],
            registry=r,
        )
        self.prefix_hit_tokens = Gauge(
            "hybridgen_prefix_hit_tokens",
            "Prompt tokens the prefix cache served from a tier (not computed again), since start.",
            ["tier"],
            registry=r,
        )
        self.warm_kept = Gauge(
            "hybridgen_warm_kept_blocks",
            "Blocks of finished sequences written back to Warm for reuse, since start.",
            registry=r,
        )
        self.spill_decisions = Gauge(
            "hybridgen_spill_decisions",
            "What waiting sequences that fit Hot alone but not beside the running ones did "
            "(kv_cache.spill_policy), by choice: wait, swap, turns or spill; since start.",
            ["choice"],
            registry=r,
        )
        self.gpu_mem_peak = Gauge(
            "hybridgen_gpu_memory_peak_reserved_bytes",
            "Peak GPU memory the GPU daemon's caching allocator has reserved (0 on a CPU "
            "device; set by the backend).",
            registry=r,
        )

    def set_kv_tiers(self, info: Mapping[str, Any]) -> None:
        """Mirror the engine's KV tier figures (GetModelInfo fields) into the gauges."""
        warm_total = info.get("warm_blocks_total", 0)
        if warm_total:
            self.kv_usage.labels(tier="warm").set(info["warm_blocks_used"] / warm_total)
            self.hot_hit.set(info["hot_hit_rate"])
            for q in ("50", "95"):
                seconds = info[f"warm_decompress_p{q}_ms"] / 1e3
                self.warm_decompress.labels(quantile=f"0.{q}").set(seconds)
            self.cpu_attention.set(info["cpu_attention_ms"] / 1e3)
            self.pcie_bytes.labels(direction="h2d").set(info["pcie_h2d_bytes"])
            self.pcie_bytes.labels(direction="d2h").set(info["pcie_d2h_bytes"])
            self.warm_drafts.labels(outcome="drafted").set(info["warm_drafted_tokens"])
            self.warm_drafts.labels(outcome="accepted").set(info["warm_accepted_drafts"])
        self.prefix_cached.set(info.get("prefix_cached_tokens", 0))
        for tier in ("hot", "warm", "cold"):
            self.prefix_hits.labels(tier=tier).set(info.get(f"prefix_{tier}_hits", 0))
            self.prefix_hit_tokens.labels(tier=tier).set(info.get(f"prefix_{tier}_tokens", 0))
        self.warm_kept.set(info.get("warm_kept_blocks", 0))
        for choice in ("wait", "swap", "turns", "spill"):
            count = info.get(f"spill_decisions_{choice}", 0)
            self.spill_decisions.labels(choice=choice).set(count)

    def serve(self, port: int, host: str = "127.0.0.1") -> threading.Thread:
        """Serve /metrics over HTTP on a daemon thread; returns that thread."""
        _, thread = start_http_server(port, addr=host, registry=self.registry)
        return thread
