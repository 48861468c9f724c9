-- Appended to every scenario: one parseable result line for the bench.
function done(summary, latency, requests)
   local e = summary.errors
   io.write(string.format(
      "IDEMGATE_BENCH requests=%.0f duration_us=%.0f p50_us=%.0f p99_us=%.0f status_errors=%.0f connect=%.0f read=%.0f write=%.0f timeout=%.0f\n",
      summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
      e.status, e.connect, e.read, e.write, e.timeout))
end
