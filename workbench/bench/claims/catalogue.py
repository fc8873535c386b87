"""Every claim of the two source articles, in the order of the articles' layers: its sentence with
its number, where it comes from, the layer it is about, the device it needs and the function that
measures it.

* :data:`SERVING` (1-10): the prefix cache, the scheduler and ``workbench serve`` under load
  (:mod:`~workbench.bench.claims.serving_engine`, :mod:`~workbench.bench.claims.serving_load`,
  :mod:`~workbench.bench.claims.serving_requests`);
* :data:`MODEL` (11-16): the model, its KV memory and its precision
  (:mod:`~workbench.bench.claims.model_compute`, :mod:`~workbench.bench.claims.model_memory`,
  :mod:`~workbench.bench.claims.model_quality`);
* :data:`GPU` (17-21): read from the committed GPU results
  (:mod:`~workbench.bench.claims.gpu_stack`, :mod:`~workbench.bench.claims.gpu_bandwidth`).
"""

from __future__ import annotations

from workbench.bench.claims.core import Claim
from workbench.bench.claims.gpu_bandwidth import (
                                                 measure_decode_bandwidth,
                                                 measure_prefetch_bandwidth,
                                                 measure_w4a16_speed,
)
from workbench.bench.claims.gpu_stack import measure_full_stack, measure_fused_launches
from workbench.bench.claims.model_compute import (
                                                 measure_compute_share,
                                                 measure_prefill_scaling,
)
from workbench.bench.claims.model_memory import measure_kv_size, measure_request_memory
from workbench.bench.claims.model_quality import (
                                                 measure_calibrator_domain,
                                                 measure_cold_zone_reuse,
)
from workbench.bench.claims.serving_engine import (
                                                 measure_microbatch_window,
                                                 measure_prefix_ttft_spread,
)
from workbench.bench.claims.serving_load import (
                                                 measure_concurrency_sweet_spot,
                                                 measure_ewma_breaker,
                                                 measure_p95_vs_load,
                                                 measure_priority_header,
)
from workbench.bench.claims.serving_requests import (
                                                 measure_first_sse_chunk_64b,
                                                 measure_max_tokens_fast_path,
                                                 measure_temperature_float,
                                                 measure_temperature_zero_top_p,
)

SERVING = [
    Claim("prefix_ttft_spread",
          "50 prompts with the same opening and different endings: cross-request KV reuse narrows the TTFT spread "
          "from +-42 ms to +-8 ms, 'proving a hit rate above 92 %'; with a ~1000-token system prompt and 50 user "
          "queries, a TTFT standard deviation above 15 ms means reuse is not working",
          "A §2 (layer 2), §4.1", "prefix cache", "cpu", measure_prefix_ttft_spread),
    Claim("microbatch_window",
          "vLLM schedules at 16 ms granularity, a 0.8 ms micro-batch window instead gives a mean queue wait of "
          "0.12 ms at 1000 QPS and cuts GPU idle time from 11.3 % to 1.7 %",
          "A §2 (layer 4)", "scheduler", "cpu", measure_microbatch_window),
    Claim("p95_vs_load",
          "P95 latency stays flat at 0.45-0.49 s from 50 to 800 QPS (traditional services: P95 x2-3 from 100 to "
          "500 QPS)", "A §3.1", "serving", "cpu", measure_p95_vs_load),
    Claim("max_tokens_fast_path",
          "max_tokens >= 1.8 x input tokens activates the optimal path: input 500, max_tokens 900 -> P95 0.47 s; "
          "max_tokens 512 -> 0.63 s", "A §3.2", "serving", "cpu", measure_max_tokens_fast_path),
    Claim("temperature_float",
          "temperature 0.30000000000000004 (not a 'standard' float) triggers a software fallback path: +18 % latency",
          "A §3.2", "serving", "cpu", measure_temperature_float),
    Claim("temperature_zero_top_p",
          "temperature=0 needs top_p=0.99 to activate a 'numerically stable mode'",
          "A §5.2 (tip 2)", "serving", "cpu", measure_temperature_zero_top_p),
    Claim("first_sse_chunk_64b",
          "the first stream chunk is a fixed 64 bytes including metadata; readline() may stall on half a JSON "
          "object, so read(64) first", "A §3.2", "serving", "cpu", measure_first_sse_chunk_64b),
    Claim("ewma_breaker",
          "the typical failure is slow degradation (KV pool full: TTFT 75 -> 220 ms with 0 % errors), so circuit "
          "breakers must trip on a latency threshold learned by EWMA, not on error rate",
          "A §4.2", "serving", "cpu", measure_ewma_breaker),
    Claim("priority_header",
          "the header X-Request-Priority: high lowers P95 latency by 22 % under high load",
          "B §5.3", "scheduler", "cpu", measure_priority_header),
    Claim("concurrency_sweet_spot",
          "the best concurrency is 6 (A100, P95 1.3 s); past 8 latency climbs steeply; 10 concurrent -> mean 2.1 s",
          "B §5.3", "serving", "cpu", measure_concurrency_sweet_spot),
]

MODEL = [
    Claim("compute_share", "The model's forward is 36 % of a ~1K-token request's end-to-end time; the other 64 % is "
          "the serving stack's overhead around the model (the article: on an A100, 'pure compute' is 36 %, 64 % goes "
          "to data movement, copies and Python object management; checked here: the forward's share on this CPU)",
          "B §2.1", "model", device="cpu", measure=measure_compute_share),
    Claim("prefill_scaling", "From 512 to 2048 input tokens the old architecture's latency grows O(n^2), the fused "
          "one's close to O(n) (checked here: the log-log slope of prefill time, eager SDPA vs flash, rounds separated "
          "by 1.5)",
          "B §2.1", "model", device="cpu", measure=measure_prefill_scaling),
    Claim("kv_size_llama2_7b_32k", "Llama 2 7B at 32K tokens: K+V cache ~18 GB in FP16, so concurrency on an 80 GB "
          "A100 is capped at 4", "B §2.2", "KV memory", device="cpu", measure=measure_kv_size),
    Claim("request_memory_release", "A 1K-token request adds 2.1 GB in the old architecture vs 0.8 GB in the new "
          "(2.6x); its KV is released < 5 ms after the request ends vs 1.2 s delayed (checked here: the KV byte ratio "
          "of a whole-context contiguous cache vs paged blocks, and the time until each is verified free; the "
          "nvidia-smi part is the GPU allocator's)", "B §3.2", "KV memory", device="cpu",
          measure=measure_request_memory),
    Claim("cold_zone_reuse", "When the cold-zone reuse rate is below 15 % the pruning is too aggressive (raise "
          "cold_zone_threshold); checked one way: reuse < 15 % => quality lost beyond noise", "B §6.2", "KV tiers",
          device="cpu", measure=measure_cold_zone_reuse),
    Claim("calibrator_domain", "The precision calibrator finds W4A8 best for finance (digit-sensitive) and W4A16 for "
          "creative writing (checked here: markup-heavy reference text prefers W4A8, prose W4A16, each beyond noise)",
          "B §6.3", "quantization", device="cpu", measure=measure_calibrator_domain),
]

GPU = [
    Claim("full_stack_4x", "The full stack is ~4x faster than eager: TTFT 320 -> 75 ms, E2E 2.1 s -> < 500 ms (A §1); "
          "TTFT 820 -> 190 ms, E2E 4.7 -> 1.1 s (B §1)", "A §1 / B §1", "end to end", device="gpu",
          measure=measure_full_stack),
    Claim("fused_launches", "12 kernel launches fused into 1; one Transformer layer 18.7 -> 4.3 ms (-77 %)",
          "A §2 (layer 1)", "fused kernels", device="gpu", measure=measure_fused_launches),
    Claim("prefetch_bandwidth",
          "Asynchronous prefetch raises effective bandwidth use from 61 % to 93 %, hit rate > 89 %",
          "A §2 (layer 3)", "prefetch", device="gpu", measure=measure_prefetch_bandwidth),
    Claim("w4a16_speed", "W4A16 inference is 2.1x faster (C-Eval 62.3 -> 68.7 with per-channel scales; 1K tokens on an "
          "A100: FP16 320 ms -> 152 ms)", "B §2.3",
          "quantization", device="gpu", measure=measure_w4a16_speed),
    Claim("decode_bandwidth_bound", "Decode tracks memory bandwidth (use 41 % -> 89 %), not compute", "B §1",
          "fused kernels", device="gpu", measure=measure_decode_bandwidth),
]

CLAIMS = [*SERVING, *MODEL, *GPU]
