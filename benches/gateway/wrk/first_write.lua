-- First-time idempotent POSTs: every request carries a new Idempotency-Key
-- made of a per-thread counter, the thread id and a per-run prefix.
local prefix = os.getenv("BENCH_KEY_PREFIX") or "fw"
local path = os.getenv("BENCH_PATH") or "/v1/orders"
local body = os.getenv("BENCH_BODY") or "{}"
local headers = {
   ["Authorization"] = "Bearer " .. (os.getenv("BENCH_API_KEY") or ""),
   ["Content-Type"] = "application/json",
}

-- Keys start with a scrambled counter (Knuth's multiplicative hash), so they
-- land all over the primary-key index like client-generated UUIDs do;
-- BENCH_KEY_ORDER=sequential keeps them in counter order (index appends).
local spread = os.getenv("BENCH_KEY_ORDER") ~= "sequential"
local function key(n)
   if spread then
      return string.format("%08x-%s-%d-%d", (n * 2654435761) % 4294967296, prefix, tid, n)
   end
   return prefix .. "-" .. tid .. "-" .. n
end

local threads = 0
function setup(thread)
   thread:set("tid", threads)
   threads = threads + 1
end

-- BENCH_API_KEYS (comma-separated, optional): requests take the keys in
-- turn, one tenant each (benches/gateway/citus.rs).
local auths = {}
for k in string.gmatch(os.getenv("BENCH_API_KEYS") or "", "[^,]+") do
   auths[#auths + 1] = "Bearer " .. k
end

local counter = 0
function request()
   counter = counter + 1
   if #auths > 0 then
      headers["Authorization"] = auths[(counter + tid) % #auths + 1]
   end
   headers["Idempotency-Key"] = key(counter)
   return wrk.format("POST", path, headers, body)
end
