"""The Lua scripts of the session store (``worker.session.store``), each one atomic step in Redis:
take, renew and release a session's lease, save a step (only under the caller's lease, its
fencing token, and on the version it loaded), accept a turn request."""

from __future__ import annotations

from typing import Final

# KEYS: lease fence state history controls(of the step's turn) queue requests
# ARGV: lease_ttl_ms, session_ttl_s, turn_id ('' : not a turn's first step)
# -> {0} (held elsewhere) or {token, version, state, history, controls[, head, request]}: a
#    turn's first step also gets the session's queue head and the turn's stored request
BEGIN: Final = """
if redis.call('EXISTS', KEYS[1]) == 1 then return {0} end
local token = redis.call('INCR', KEYS[2])
redis.call('EXPIRE', KEYS[2], ARGV[2])
redis.call('SET', KEYS[1], token, 'PX', ARGV[1])
local state = redis.call('HMGET', KEYS[3], 'v', 's')
local reply = {token, state[1] or false, state[2] or false,
               table.concat(redis.call('LRANGE', KEYS[4], 0, -1)), redis.call('HGETALL', KEYS[5])}
if ARGV[3] ~= '' then
  reply[6] = redis.call('LINDEX', KEYS[6], 0) or ''
  reply[7] = redis.call('HGET', KEYS[7], ARGV[3]) or ''
end
return reply
"""

# KEYS: lease controls ; ARGV: token, ttl_ms -> 0 lost, 1 held, 2 held and the turn is cancelled
RENEW: Final = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  if redis.call('HEXISTS', KEYS[2], 'cancel') == 1 then return 2 end
  return 1 end
return 0
"""

# Record a control message of a turn once (field 'cancel', or 'decision:<call id>').
# KEYS: turns controls ; ARGV: turn_id, field, blob, ttl_s
# -> {'unknown'} (never accepted), {'finished'}, or {'recorded' | 'again' (a copy), parked}:
#    ``parked`` is the step the turn is parked at ('' when it is not parked)
CONTROL: Final = """
local status = redis.call('HGET', KEYS[1], ARGV[1])
if not status then return {'unknown'} end
if status == 'done' then return {'finished'} end
local new = redis.call('HSETNX', KEYS[2], ARGV[2], ARGV[3])
redis.call('EXPIRE', KEYS[2], ARGV[4])
local parked = redis.call('HGET', KEYS[2], 'parked') or ''
if new == 1 then return {'recorded', parked} end
return {'again', parked}
"""

# End a turn still queued behind others (it never started).
# KEYS: turns queue requests result replies controls ; ARGV: turn_id, result_blob, ttl_s
# -> {'head'} (it is the running turn: end it under the lease), {'finished'}, {'ended', replies}
END_QUEUED: Final = """
if redis.call('LINDEX', KEYS[2], 0) == ARGV[1] then return {'head'} end
local status = redis.call('HGET', KEYS[1], ARGV[1])
if (not status) or status == 'done' then return {'finished'} end
redis.call('LREM', KEYS[2], 0, ARGV[1])
redis.call('HSET', KEYS[1], ARGV[1], 'done')
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('SET', KEYS[4], ARGV[2], 'EX', ARGV[3])
redis.call('DEL', KEYS[6])
return {'ended', redis.call('HGET', KEYS[5], ARGV[1]) or ''}
"""

# KEYS: lease ; ARGV: token
RELEASE: Final = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) return 1 end
return 0
"""

# KEYS: lease state list result turns queue requests transient replies controls
# ARGV: token, expected_version, state_blob, release lease(0/1), ttl_s, result_blob|'', turn_id,
#       parked, n, msg...
# ``list`` is where the messages go (the history, or a persist: false turn's own list, which
# ``transient`` names and a result deletes). ``parked``: the step a turn parks at (recorded in
# its controls, so that whoever records a control message kicks that step), '-' when it
# resumes (the controls that woke it, now in its state, are dropped with it; a cancel stays),
# '' otherwise. Returns {version, next head, replies, controls waiting}: the last is 1
# when a turn parks while control messages for it were recorded already (it resumes at once).
SAVE: Final = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return redis.error_reply('STALE lease lost') end
local v = tonumber(redis.call('HGET', KEYS[2], 'v') or '0')
if v ~= tonumber(ARGV[2]) then return redis.error_reply('STALE version ' .. v) end
redis.call('HSET', KEYS[2], 'v', v + 1, 's', ARGV[3])
local n = tonumber(ARGV[9])
if n > 0 then
  redis.call('RPUSH', KEYS[3], unpack(ARGV, 10, 9 + n))
  redis.call('EXPIRE', KEYS[3], ARGV[5])
end
local waiting = 0
if ARGV[8] == '-' then
  -- it goes on: what woke it is in its state now; only a cancel is kept
  local cancel = redis.call('HGET', KEYS[10], 'cancel')
  redis.call('DEL', KEYS[10])
  if cancel then redis.call('HSET', KEYS[10], 'cancel', cancel) redis.call('EXPIRE', KEYS[10], ARGV[5]) end
elseif ARGV[8] ~= '' then
  redis.call('HSET', KEYS[10], 'parked', ARGV[8])
  redis.call('EXPIRE', KEYS[10], ARGV[5])
  if redis.call('HLEN', KEYS[10]) > 1 then waiting = 1 end
end
local head, replies = '', ''
if ARGV[6] ~= '' then
  local ttl = tonumber(ARGV[5])
  redis.call('SET', KEYS[4], ARGV[6], 'EX', ttl)
  redis.call('HSET', KEYS[5], ARGV[7], 'done')
  if redis.call('LINDEX', KEYS[6], 0) == ARGV[7] then redis.call('LPOP', KEYS[6]) end
  redis.call('HDEL', KEYS[7], ARGV[7])
  redis.call('DEL', KEYS[8], KEYS[10])
  head = redis.call('LINDEX', KEYS[6], 0) or ''
  replies = redis.call('HGET', KEYS[9], ARGV[7]) or ''
  for i = 2, 5 do redis.call('EXPIRE', KEYS[i], ttl) end
  redis.call('EXPIRE', KEYS[7], ttl)
  redis.call('EXPIRE', KEYS[9], ttl)
end
if ARGV[4] == '1' then redis.call('DEL', KEYS[1]) end
return {v + 1, head, replies, waiting}
"""

# KEYS: turns requests queue result replies erasing lease
# ARGV: turn_id, request_blob, ttl_s, reply_to|'', now
# While the session is erased (``erasing`` holds the token of the lease) nothing is written:
# {'erasing'}.
# A turn's status is 'queued <accepted at>' until it is 'done': a copy of it is announced with
# the time the first was accepted.
# The replies field of a turn lists every reply queue its copies named, space-separated (a
# reply_to has no spaces): a copy published while the turn runs gets the result too.
ACCEPT: Final = """
local erasing = redis.call('GET', KEYS[6])
if erasing and erasing == redis.call('GET', KEYS[7]) then return {'erasing', ''} end
if redis.call('HSETNX', KEYS[1], ARGV[1], 'queued ' .. ARGV[5]) == 0 then
  local res = redis.call('GET', KEYS[4])
  if res then return {'done', res} end
  local status = redis.call('HGET', KEYS[1], ARGV[1]) or ''
  if ARGV[4] ~= '' then
    local cur = redis.call('HGET', KEYS[5], ARGV[1])
    if not cur then
      redis.call('HSET', KEYS[5], ARGV[1], ARGV[4])
    elseif not string.find(' ' .. cur .. ' ', ' ' .. ARGV[4] .. ' ', 1, true) then
      redis.call('HSET', KEYS[5], ARGV[1], cur .. ' ' .. ARGV[4])
    end
    redis.call('EXPIRE', KEYS[5], ARGV[3])
  end
  return {'pending', '', string.sub(status, 8)}
end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
if ARGV[4] ~= '' then
  redis.call('HSET', KEYS[5], ARGV[1], ARGV[4])
  redis.call('EXPIRE', KEYS[5], ARGV[3])
end
local len = redis.call('RPUSH', KEYS[3], ARGV[1])
for i = 1, 3 do redis.call('EXPIRE', KEYS[i], ARGV[3]) end
if len == 1 then return {'start', '', ARGV[5]} end
return {'queued', tostring(len - 1), ARGV[5]}
"""

# Erasing a session, under its lease. KEYS: lease erasing queue ; ARGV: token, ttl_ms
# -> 1: marked (accepts are refused while the lease is the mark's), 0: the lease is lost or
#    a turn is queued (the erasure is judged again)
ERASE_MARK: Final = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if redis.call('LLEN', KEYS[3]) > 0 then return 0 end
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
return 1
"""

# KEYS: lease erasing key... (all of one session) ; ARGV: token, ttl_ms, last (0/1)
# -> the number of keys deleted, or -1 when the lease or the mark is lost. ``last``: the mark
#    and the lease go too (the lease counted as deleted).
ERASE_KEYS: Final = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] or redis.call('GET', KEYS[2]) ~= ARGV[1] then
  return -1 end
local n = 0
if #KEYS > 2 then n = redis.call('UNLINK', unpack(KEYS, 3)) end
if ARGV[3] == '1' then
  redis.call('DEL', KEYS[2])
  n = n + redis.call('DEL', KEYS[1])
else
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
end
return n
"""

# Fleet-wide model rate limits, GCRA: each key holds its limit's theoretical arrival time (ms);
# a minute's worth of requests (tokens) may come at once. Both limits admit a call together,
# or neither changes and the call waits for the later of the two.
# KEYS: requests tokens (one endpoint's, one hash tag) ; ARGV: now_ms, rpm, tpm, tokens
# -> 0 (admitted) or the milliseconds to wait
ADMIT: Final = """
local now = tonumber(ARGV[1])
local function next_tat(key, per_minute, cost)
  if per_minute <= 0 or cost <= 0 then return nil, 0 end
  local tat = tonumber(redis.call('GET', key) or '0')
  if tat < now then tat = now end
  local new = tat + cost * 60000 / per_minute
  return new, math.max(0, new - 60000 - now)
end
local rtat, rwait = next_tat(KEYS[1], tonumber(ARGV[2]), 1)
local ttat, twait = next_tat(KEYS[2], tonumber(ARGV[3]), math.min(tonumber(ARGV[4]), tonumber(ARGV[3])))
local wait = math.max(rwait, twait)
if wait > 0 then return math.ceil(wait) end
if rtat then redis.call('SET', KEYS[1], rtat, 'PX', 120000) end
if ttat then redis.call('SET', KEYS[2], ttat, 'PX', 120000) end
return 0
"""
