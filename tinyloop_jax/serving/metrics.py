"""`/metrics`: the engine's counters as Prometheus metric families (`prometheus_client`)."""

from __future__ import annotations

from .engine import Engine


class Collector:
    """The engine's counters as Prometheus metric families."""

    COUNTERS = dict(requests="requests submitted", requests_rejected="requests refused (queue full)",
                    requests_failed="requests failed", tokens_in="prompt tokens received",
                    tokens_out="tokens emitted", prefix_tokens_reused="prompt tokens read from cached prefixes",
                    requests_prefix_hit="requests that reused a cached prefix",
                    requests_prefix_miss="requests with no cached prefix", prefill_chunks="prompt chunks run",
                    decode_steps="batched decode steps", batch_rows="rows decoded, summed over steps",
                    compiles_after_warmup="programs compiled after warmup",
                    depths_evicted="idle depths evicted to stay within the memory budget")
    GAUGES = dict(queue_depth="requests waiting", running="requests in the batch",
                  mean_batch_size="rows per decode step (mean)", prefix_hit_rate="share of requests with a prefix hit",
                  ttft_p50_s="time to first token, median of recent requests (s)",
                  ttft_p99_s="time to first token, p99 of recent requests (s)",
                  tokens_per_second="tokens emitted per second since start",
                  depths_held="depths held now (each a page pool, request rows and programs)",
                  memory_bytes="bytes the depths' page pools and request rows hold (within the memory budget)",
                  memory_budget="bytes the page pools and request rows may hold (--memory-budget; 0: none)",
                  budget_tokens="tokens the memory budget holds at the model's default depth")

    # per depth (label `loops`), in tokens, as vLLM names its prefix-cache counters
    DEPTH_COUNTERS = dict(prefix_cache_queries="prompt tokens looked up in cached prefixes",
                          prefix_cache_hits="prompt tokens found in cached prefixes (read, not computed)",
                          tokens_computed="positions run through the model (prompt and decode)",
                          passes="loop passes run (positions x loops, less the passes adaptive exits skipped): "
                                 "passes / tokens = passes per token",
                          passes_skipped="loop passes skipped by adaptive-depth exits (exit_criterion)")

    # per replica (label `replica`, `tinyloop serve --replicas`), as the ingress counts them
    REPLICA_COUNTERS = dict(requests="requests the replica finished", tokens_in="their prompt tokens",
                            tokens_out="tokens they emitted",
                            prefix_tokens_reused="their prompt tokens the replica read from cached prefixes",
                            requests_failed="requests that failed there")
    REPLICA_GAUGES = dict(queue_depth="requests waiting there (its engine's count)",
                          running="requests in its batch", prefix_hit_rate="share of its requests with a prefix hit",
                          memory_bytes="bytes its page pools and rows hold", tokens_per_second="its tokens per second",
                          ttft_p50_s="its time to first token, median (s)",
                          ttft_p99_s="its time to first token, p99 (s)")

    # several engines: Ray's count and the poll's (a replica running but not answering is the one to look at)
    REPLICA_TOTALS = dict(replicas_running="engine replicas Ray runs",
                          replicas_answering="engine replicas that answered the ingress's last poll")

    def __init__(self, engine: Engine):
        self.engine = engine

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.engine.stats()
        for name, doc in self.COUNTERS.items():
            yield CounterMetricFamily(f"tinyloop_{name}", doc, value=s.get(name, 0))
        finished = CounterMetricFamily("tinyloop_requests_finished", "requests finished, by reason",
                                       labels=["reason"])
        for reason in ("stop", "length", "cancelled", "timeout", "error"):
            finished.add_metric([reason], s.get(f"finished_{reason}", 0))
        yield finished
        for name, doc in self.GAUGES.items():
            yield GaugeMetricFamily(f"tinyloop_{name}", doc, value=s.get(name) or 0)
        for name, doc in self.REPLICA_TOTALS.items():
            if name in s:
                yield GaugeMetricFamily(f"tinyloop_{name}", doc, value=s[name])
        for name, doc in self.REPLICA_COUNTERS.items():  # several engines: what the ingress saw of each
            family = CounterMetricFamily(f"tinyloop_replica_{name}", doc, labels=["replica"])
            for replica, counts in sorted(s.get("replicas", {}).items()):
                family.add_metric([replica], counts.get(name, 0))
            yield family
        for name, doc in self.REPLICA_GAUGES.items():  # ... and what each replica's engine says of itself
            family = GaugeMetricFamily(f"tinyloop_replica_{name}", doc, labels=["replica"])
            for replica, counts in sorted(s.get("replicas", {}).items()):
                if name in counts:
                    family.add_metric([replica], counts[name])
            yield family
        for name, doc in self.DEPTH_COUNTERS.items():
            family = CounterMetricFamily(f"tinyloop_{name}", doc, labels=["loops"])
            for loops, counts in sorted(s.get("depths", {}).items()):
                family.add_metric([str(loops)], counts.get(name, 0))
            yield family
