-- wrk script for security-unauth-flood.sh: each thread stops after FLOOD_PER_THREAD responses,
-- and counts them by status (printed at the end, per thread, as "status N" lines on stderr).
local per_thread = tonumber(os.getenv("FLOOD_PER_THREAD") or "50000")
local threads = {}

function setup(thread)
    table.insert(threads, thread)
end

function init(args)
    count = 0
    statuses = {}
end

function response(status, headers, body)
    count = count + 1
    statuses[status] = (statuses[status] or 0) + 1
    if count >= per_thread then
        wrk.thread:stop()
    end
end

function done(summary, latency, requests)
    for _, t in ipairs(threads) do
        local s = t:get("statuses")
        for status, n in pairs(s) do
            io.stderr:write(string.format("status %d %d\n", status, n))
        end
    end
end
