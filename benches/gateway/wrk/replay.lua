-- Replays: keys that are already completed. Keys are
-- string.format(BENCH_KEY_FORMAT, n) for n in [BENCH_KEY_FIRST, +BENCH_KEY_COUNT),
-- cycled from a per-thread offset, or drawn at random with BENCH_KEY_RANDOM=1.
local path = os.getenv("BENCH_PATH") or "/v1/orders"
local body = os.getenv("BENCH_BODY") or "{}"
local fmt = os.getenv("BENCH_KEY_FORMAT") or "%d"
local first = tonumber(os.getenv("BENCH_KEY_FIRST") or "0")
local count = tonumber(os.getenv("BENCH_KEY_COUNT") or "1")
local random = os.getenv("BENCH_KEY_RANDOM") == "1"
local headers = {
   ["Authorization"] = "Bearer " .. (os.getenv("BENCH_API_KEY") or ""),
   ["Content-Type"] = "application/json",
}

-- BENCH_API_KEYS (comma-separated, optional): key n is replayed with API
-- key n % count, as benches/gateway/citus.rs populated it (one tenant each).
local auths = {}
for k in string.gmatch(os.getenv("BENCH_API_KEYS") or "", "[^,]+") do
   auths[#auths + 1] = "Bearer " .. k
end

local threads = 0
function setup(thread)
   thread:set("tid", threads)
   threads = threads + 1
end

local i = 0
function init(args)
   i = (tid * 7919) % count
   math.randomseed(tid + 1)
end

function request()
   local n
   if random then
      n = math.random(0, count - 1)
   else
      n = i
      i = (i + 1) % count
   end
   if #auths > 0 then
      headers["Authorization"] = auths[n % #auths + 1]
   end
   headers["Idempotency-Key"] = string.format(fmt, first + n)
   return wrk.format("POST", path, headers, body)
end
