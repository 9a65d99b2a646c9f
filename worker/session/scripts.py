"""The Lua scripts of the session store (``worker.session.store``), each one atomic step in Redis:
take, renew and release a session's lease, save a step (only under the caller's lease, its
fencing token, and on the version it loaded), accept a turn request (a turn id once, in one
session).

Expiry: accepting a turn, taking or renewing the lease, recording a control message and every
save keep each key of the session they name alive at least the given lifetime more
(``KEEP``: a longer expiry stays, a key without one gets one); the save that ends a turn sets
every key of the session to expire exactly ``ttl_s`` after it."""

from __future__ import annotations

from typing import Final

# keep(s, i, j): each of KEYS[i..j] that exists lives at least s seconds more (a longer expiry
# is kept, a key without one gets one)
KEEP: Final = """
local function keep(s, i, j)
  s = tonumber(s)
  for k = i, j do
    local t = redis.call('TTL', KEYS[k])
    if t == -1 or (t >= 0 and t < s) then redis.call('EXPIRE', KEYS[k], s) end
  end
end
"""


def _keeping(body: str) -> str:
    """A script that may call ``keep``."""
    return KEEP + body


# KEYS: lease fence state history controls(of the step's turn) queue requests turns replies
#       steps(of the step's turn)
# ARGV: lease_ttl_ms, session_ttl_s, turn_id ('' : not a turn's first step), generation|'' and
#       items: the history the worker holds already (``worker.session.history_cache``)
# -> {0} (held elsewhere) or {token, version, state, history, controls, generation, from, items,
#    head, request}: ``history`` is the list's items from ``from`` on, concatenated (from 0,
#    unless the worker's generation is the history's and its items are still the list's first);
#    ``generation`` is the history's ('' while no save of this release vouches for it: then
#    nothing is cached); ``items`` the list's length. A turn's first step also gets the
#    session's queue head and the turn's stored request ('' otherwise).
BEGIN: Final = _keeping("""
if redis.call('EXISTS', KEYS[1]) == 1 then return {0} end
local token = redis.call('INCR', KEYS[2])
keep(ARGV[2], 2, 10)
redis.call('SET', KEYS[1], token, 'PX', ARGV[1])
local state = redis.call('HMGET', KEYS[3], 'v', 's', 'h', 'w')
local gen = ''
if state[3] and state[4] == state[1] then gen = state[3] end
local from = 0
if gen ~= '' and gen == ARGV[4] then
  from = tonumber(ARGV[5])
  if redis.call('LLEN', KEYS[4]) < from then from = 0 end
end
local items = redis.call('LRANGE', KEYS[4], from, -1)
local reply = {token, state[1] or false, state[2] or false, table.concat(items),
               redis.call('HGETALL', KEYS[5]), gen, from, from + #items, '', ''}
if ARGV[3] ~= '' then
  reply[9] = redis.call('LINDEX', KEYS[6], 0) or ''
  reply[10] = redis.call('HGET', KEYS[7], ARGV[3]) or ''
end
return reply
""")

# KEYS: lease controls state history fence queue turns requests replies transient steps
# ARGV: token, ttl_ms, session_ttl_s -> 0 lost, 1 held, 2 held and the turn is cancelled
RENEW: Final = _keeping("""
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  keep(ARGV[3], 2, 11)
  if redis.call('HEXISTS', KEYS[2], 'cancel') == 1 then return 2 end
  return 1 end
return 0
""")

# Record a control message of a turn once (field 'cancel', or 'decision:<call id>'); the
# session's keys live at least ``ttl_s`` more (a control message is activity of the session).
# KEYS: turns controls state history fence queue requests replies steps ; ARGV: turn_id, field,
#       blob, ttl_s
# -> {'unknown'} (never accepted), {'finished'}, or {'recorded' | 'again' (a copy), parked}:
#    ``parked`` is the step the turn is parked at ('' when it is not parked)
CONTROL: Final = _keeping("""
local status = redis.call('HGET', KEYS[1], ARGV[1])
if not status then return {'unknown'} end
if status == 'done' then return {'finished'} end
local new = redis.call('HSETNX', KEYS[2], ARGV[2], ARGV[3])
keep(ARGV[4], 1, 9)
local parked = redis.call('HGET', KEYS[2], 'parked') or ''
if new == 1 then return {'recorded', parked} end
return {'again', parked}
""")

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

# KEYS: lease state list result turns queue requests transient replies controls fence history
#       calls children steps [index: the turn's session index, given twice the session's expiry
#       (on one Redis; on a cluster it is renewed beside the script)]
# ARGV: token, expected_version, state_blob, release lease(0/1), ttl_s, result_blob|'', turn_id,
#       parked, step_record|'', n, msg..., m, call... (the idempotency keys of the tool calls the
#       step's model answer asked for, added to ``calls``), cut_to|''
# ``cut_to`` (a turn cancelled with rollback, with its result): ``history`` is cut back to its
# first ``cut_to`` messages.
# ``list`` is where the messages go (the history, or a persist: false turn's own list, which
# ``transient`` names and a result deletes; ``history`` is the session's, kept alive either
# way). ``step_record``: the record of the step this save completes, appended to the turn's
# ``steps`` list (once: the save is refused as stale if done again). ``parked``: the step a turn
# parks at (recorded in its controls, so that whoever records a control message kicks that
# step), '-' when it resumes (the controls that woke it, now in its state, are dropped with it;
# a cancel stays), '' otherwise. ``ttl_s``: how long every key of the session lives at least
# after this save (a parked turn's keys outlive its wait); a result sets them to expire exactly
# ``ttl_s`` after it. Returns {version, next head, replies, controls waiting, cancel, generation}:
# ``controls waiting`` is 1 when a turn parks while control messages for it were recorded
# already (it resumes at once); ``cancel`` the turn's recorded cancel ('' when none, or the
# turn ended); ``generation`` the history's after the save.
# The history's generation (state field ``h``) stays while saves only append to the history,
# each save of this release vouching for it (``w``: the version it wrote); it is new after a
# cut, for a new state, and after a save that did not vouch (a worker of an earlier release,
# which may have cut the history): a worker's cached copy of the history holds only under the
# generation it was read with (``worker.session.history_cache``).
SAVE: Final = _keeping("""
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return redis.error_reply('STALE lease lost') end
local st = redis.call('HMGET', KEYS[2], 'v', 'h', 'w')
local v = tonumber(st[1] or '0')
if v ~= tonumber(ARGV[2]) then return redis.error_reply('STALE version ' .. v) end
local n = tonumber(ARGV[10])
local m = tonumber(ARGV[11 + n] or '0')
local cut = ARGV[12 + n + m]
local gen = st[2]
if (not gen) or st[3] ~= st[1] or (cut and cut ~= '') then
  local now = redis.call('TIME')
  gen = ARGV[1] .. '.' .. now[1] .. now[2]
end
redis.call('HSET', KEYS[2], 'v', v + 1, 's', ARGV[3], 'h', gen, 'w', v + 1)
if ARGV[9] ~= '' then redis.call('RPUSH', KEYS[15], ARGV[9]) end
if n > 0 then redis.call('RPUSH', KEYS[3], unpack(ARGV, 11, 10 + n)) end
if m > 0 then redis.call('SADD', KEYS[13], unpack(ARGV, 12 + n, 11 + n + m)) end
if cut and cut ~= '' then
  if tonumber(cut) > 0 then redis.call('LTRIM', KEYS[12], 0, tonumber(cut) - 1)
  else redis.call('DEL', KEYS[12]) end
end
local waiting = 0
local cancel = redis.call('HGET', KEYS[10], 'cancel')
if ARGV[8] == '-' then
  -- it goes on: what woke it is in its state now; only a cancel is kept
  redis.call('DEL', KEYS[10])
  if cancel then redis.call('HSET', KEYS[10], 'cancel', cancel) end
elseif ARGV[8] ~= '' then
  redis.call('HSET', KEYS[10], 'parked', ARGV[8])
  if redis.call('HLEN', KEYS[10]) > 1 then waiting = 1 end
end
local head, replies = '', ''
if ARGV[6] ~= '' then
  redis.call('SET', KEYS[4], ARGV[6], 'EX', ARGV[5])
  redis.call('HSET', KEYS[5], ARGV[7], 'done')
  if redis.call('LINDEX', KEYS[6], 0) == ARGV[7] then redis.call('LPOP', KEYS[6]) end
  redis.call('HDEL', KEYS[7], ARGV[7])
  redis.call('DEL', KEYS[8], KEYS[10])
  cancel = false
  head = redis.call('LINDEX', KEYS[6], 0) or ''
  replies = redis.call('HGET', KEYS[9], ARGV[7]) or ''
  for i = 2, 15 do redis.call('EXPIRE', KEYS[i], ARGV[5]) end
else
  keep(ARGV[5], 2, 15)
end
if KEYS[16] then redis.call('EXPIRE', KEYS[16], 2 * ARGV[5]) end
if ARGV[4] == '1' then redis.call('DEL', KEYS[1]) end
return {v + 1, head, replies, waiting, cancel or '', gen}
""")

# KEYS: turns requests queue result replies state history fence erasing lease [index]
# ARGV: turn_id, request_blob, ttl_s, reply_to|'', now, session_id
# While the session is erased (``erasing`` holds the token of the lease) nothing is written:
# {'erasing'}.
# A turn's status is 'queued <accepted at>' until it is 'done': a copy of it is announced with
# the time the first was accepted.
# The replies field of a turn lists every reply queue its copies named, space-separated (a
# reply_to has no spaces): a copy published while the turn runs gets the result too.
# ``index`` (the turn's session index, on one Redis; on a Redis Cluster it lives in another
# slot and ``CLAIM`` writes it first): a turn id another session accepted is refused,
# {'in_use'}, and nothing is written.
ACCEPT: Final = _keeping("""
local erasing = redis.call('GET', KEYS[9])
if erasing and erasing == redis.call('GET', KEYS[10]) then return {'erasing', ''} end
if KEYS[11] then
  local owner = redis.call('GET', KEYS[11])
  if owner and owner ~= ARGV[6] then return {'in_use', ''} end
  if not owner then redis.call('SET', KEYS[11], ARGV[6], 'EX', 2 * ARGV[3]) end
  keep(2 * ARGV[3], 11, 11)
end
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
  end
  keep(ARGV[3], 1, 8)
  return {'pending', '', string.sub(status, 8)}
end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
if ARGV[4] ~= '' then redis.call('HSET', KEYS[5], ARGV[1], ARGV[4]) end
local len = redis.call('RPUSH', KEYS[3], ARGV[1])
keep(ARGV[3], 1, 8)
if len == 1 then return {'start', '', ARGV[5]} end
return {'queued', tostring(len - 1), ARGV[5]}
""")

# A turn id's session index, claimed for a session before its accept (on a Redis Cluster,
# where the index is in another slot than the session's keys), and kept alive twice the
# session's lifetime: the index outlives every key of its turn.
# KEYS: index ; ARGV: session_id, ttl_s -> 1 (the session's: claimed now or before), 0 (another's)
CLAIM: Final = _keeping("""
local owner = redis.call('GET', KEYS[1])
if owner and owner ~= ARGV[1] then return 0 end
if not owner then redis.call('SET', KEYS[1], ARGV[1], 'EX', 2 * ARGV[2]) end
keep(2 * ARGV[2], 1, 1)
return 1
""")

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

# A turn's session index deleted with its session, only while it names that session.
# KEYS: index ; ARGV: session_id -> 1 (deleted) or 0
DROP_INDEX: Final = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# Fleet-wide model rate limits, GCRA: each key holds its limit's theoretical arrival time (ms);
# a minute's worth of requests (tokens) may come at once. Both limits admit a call together,
# or neither changes and the call waits for the later of the two. Time is Redis's own (TIME),
# never a worker's clock: workers whose clocks disagree share the limit all the same.
# KEYS: requests tokens (one endpoint's, one hash tag) ; ARGV: rpm, tpm, tokens
# -> 0 (admitted) or the milliseconds to wait
ADMIT: Final = """
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local function next_tat(key, per_minute, cost)
  if per_minute <= 0 or cost <= 0 then return nil, 0 end
  local tat = tonumber(redis.call('GET', key) or '0')
  if tat < now then tat = now end
  local new = tat + cost * 60000 / per_minute
  return new, math.max(0, new - 60000 - now)
end
local rtat, rwait = next_tat(KEYS[1], tonumber(ARGV[1]), 1)
local ttat, twait = next_tat(KEYS[2], tonumber(ARGV[2]), math.min(tonumber(ARGV[3]), tonumber(ARGV[2])))
local wait = math.max(rwait, twait)
if wait > 0 then return math.ceil(wait) end
if rtat then redis.call('SET', KEYS[1], rtat, 'PX', 120000) end
if ttat then redis.call('SET', KEYS[2], ttat, 'PX', 120000) end
return 0
"""

# What ADMIT charged, given back (a tenant's charge for a call the endpoint's limit then
# refused: worker.model.ratelimit): each arrival time moves back by the call's cost, never
# before now. KEYS and ARGV: ADMIT's -> 0
REFUND: Final = """
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local function give_back(key, per_minute, cost)
  if per_minute <= 0 or cost <= 0 then return end
  local tat = tonumber(redis.call('GET', key) or '0')
  if tat <= now then return end
  redis.call('SET', key, math.max(now, tat - cost * 60000 / per_minute), 'PX', 120000)
end
give_back(KEYS[1], tonumber(ARGV[1]), 1)
give_back(KEYS[2], tonumber(ARGV[2]), math.min(tonumber(ARGV[3]), tonumber(ARGV[2])))
return 0
"""
