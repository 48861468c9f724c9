-- A mix: 75% first writes, 20% retries of keys completed a while ago
-- (replays), 5% the newest key again (usually still in flight on another
-- connection of the thread: same-key concurrency).
local prefix = os.getenv("BENCH_KEY_PREFIX") or "mix"
local path = os.getenv("BENCH_PATH") or "/v1/orders"
local body = os.getenv("BENCH_BODY") or "{}"
local headers = {
   ["Authorization"] = "Bearer " .. (os.getenv("BENCH_API_KEY") or ""),
   ["Content-Type"] = "application/json",
}
-- A key issued this many requests ago on the thread is surely completed.
local LAG = 256
local WINDOW = 4096

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

function init(args)
   math.randomseed(tid + 1)
end

local counter = 0
function request()
   local r = math.random()
   local n
   if r < 0.05 and counter > 0 then
      n = counter
   elseif r < 0.25 and counter > LAG then
      n = counter - LAG - math.random(0, math.min(counter - LAG - 1, WINDOW))
   else
      counter = counter + 1
      n = counter
   end
   headers["Idempotency-Key"] = key(n)
   return wrk.format("POST", path, headers, body)
end
